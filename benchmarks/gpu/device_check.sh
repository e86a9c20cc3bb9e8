#!/usr/bin/env bash
# The device check on a lent GPU node, as one call of the device tool (docs/gpu-path.md, "Running the device check").
# Made here first:  .venv/bin/python benchmarks/gpu/device_check.py --prepare .gpu --ort
# onnxruntime-gpu reaches the node in parts, one call each, on the same warm machine:
#   command "mkdir -p ~/stage && cp .gpu/ort/* ~/stage/", carry [".gpu/ort/name", ".gpu/ort/part.00"], then part.01 ...
# then:  command "bash benchmarks/gpu/device_check.sh", carry [".gpu/wheels", ".gpu/model",
#        ".gpu/bpe_simple_vocab_16e6.txt.gz"] (about 37 MB; the external-data copy and the LoRA folder are derived
#        on the node), timeout_s 590. Extra arguments go to device_check.py (e.g. --only 1,2,3,4,6,7 to leave out
#        the full-size UNet, the long step).
set -uo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "nvidia-smi: not found"
SITE="$HOME/site"
mkdir -p "$SITE"
python3 -m pip install -q --no-index --no-deps --target "$SITE" .gpu/wheels/*.whl 2>&1 | tail -3
if [ -f "$HOME/stage/name" ]; then  # onnxruntime-gpu, staged by the earlier calls
  WHEEL="$HOME/$(cat "$HOME/stage/name")"
  cat "$HOME"/stage/part.* > "$WHEEL" && python3 -m pip install -q --no-index --no-deps --target "$SITE" "$WHEEL"
fi
# onnxruntime-gpu installed with --target looks for CUDA and cuDNN beside itself: point the loader at torch's wheels.
NVIDIA=$(python3 -c 'import nvidia; print(list(nvidia.__path__)[0])' 2>/dev/null || true)
for lib in "$NVIDIA"/*/lib "$NVIDIA"/cu*/lib; do
  [ -d "$lib" ] && LD_LIBRARY_PATH="$lib:${LD_LIBRARY_PATH:-}"
done
export LD_LIBRARY_PATH="${LD_LIBRARY_PATH:-}" PYTHONPATH="$SITE:$PWD"
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.get_available_providers())"
timeout 560 python3 benchmarks/gpu/device_check.py --work .gpu "$@"
