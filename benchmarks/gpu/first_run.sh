#!/usr/bin/env bash
# The first device run, as one call on the device machine (shared GPU.md): the carried wheels in .gpu/wheels
# installed into ~/site (no network there), onnxruntime-gpu from the pieces staged in ~/stage by earlier calls
# (GPU.md, "Getting onnxruntime-gpu onto the device"), then the five steps, one line each.
# Prepare here first:  .venv/bin/python benchmarks/gpu/first_run.py --prepare .gpu
#                      .venv/bin/python -m pip download -d .gpu/wheels --only-binary=:all: --python-version 3.12 \
#                        --implementation cp --platform manylinux_2_28_x86_64 -r benchmarks/gpu/device-wheels.txt
# then: run(command="bash benchmarks/gpu/first_run.sh", carry=[".gpu"], timeout_s=480)
set -uo pipefail
cd "$(dirname "$0")/../.."
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || echo "no nvidia-smi"
python3 -m pip install -q --no-index --no-deps --target ~/site .gpu/wheels/*.whl 2>&1 | tail -2
if ls ~/stage/ort.part.* >/dev/null 2>&1; then
  cat ~/stage/ort.part.* > ~/ort.whl && python3 -m pip install -q --no-index --no-deps --target ~/site ~/ort.whl
fi
export PYTHONPATH="$HOME/site:$PWD"
python3 -c "import onnxruntime as o; o.preload_dlls(); print('onnxruntime', o.__version__, o.get_available_providers())"
timeout 420 python3 benchmarks/gpu/first_run.py --work .gpu
