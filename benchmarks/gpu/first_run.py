"""The first device run (shared GPU.md, "The first device run"): five steps, one printed line each, on a lent GPU.

Run from the repository root on the device machine, after `benchmarks/gpu/first_run.sh` put the carried wheels on
``PYTHONPATH``:  ``python3 benchmarks/gpu/first_run.py --work .gpu``. ``.gpu/`` is made here on a CPU machine by
``python benchmarks/gpu/first_run.py --prepare .gpu`` (the tiny model, its external-data copy, a PEFT LoRA file, the
64x64 production profile and the build plans), so the device spends its minutes on the GPU, not on exports.

Every step prints ``STEP <n> <name>: OK|FAIL ...`` and never stops the others. ``--rehearse`` runs the same steps on
a machine without a GPU (the suite does: tests/integration/test_gpu_first_run.py), where steps 2-5 must FAIL for the
GPU's absence, with ORT's words, and step 1 must show every option set accepted by ORT's parser.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SIZE = 64
PROFILE_EXTRA = f"""
[serving]
sizes = ["{SIZE}x{SIZE}"]
batch_sizes = [1]

[selftest]
timed_runs = 1
require_fingerprints = false

[queue]
max_batch = 1

[limits]
max_n = 1
"""


def _cli(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "server.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def _profile(work: Path, providers: list[str]) -> Path:
    text = (ROOT / "configs" / "production.toml").read_text()
    for section in ("[serving]", "[selftest]", "[queue]", "[limits]"):  # replaced by PROFILE_EXTRA's
        start = text.index(section)
        end = text.find("\n[", start + 1)
        text = text[:start] + (text[end + 1:] if end != -1 else "")
    text = text.replace('providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]',
                        f"providers = {json.dumps(providers)}")
    path = work / f"profile-{'-'.join(p[:4].lower() for p in providers)}.toml"
    path.write_text(text + PROFILE_EXTRA)
    return path


def prepare(work: Path) -> None:
    """On a CPU machine with the build extra: everything the device steps read."""
    import onnx

    from engines.artifacts import read_manifest, write_model_manifest
    from engines.build.tiny import build_tiny

    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    tiny = build_tiny(work / "tiny", diffusers_out=work / "tiny-diffusers")
    external = work / "tiny-external"
    shutil.copytree(tiny, external)
    unet = external / "unet" / "model.onnx"
    onnx.save(onnx.load(str(unet)), str(unet), save_as_external_data=True, location="model.onnx_data",
              size_threshold=1024)
    write_model_manifest(external, {k: v for k, v in read_manifest(external / "manifest.json").items()
                                    if k != "files"})
    _lora(work / "tiny-diffusers", work / "loras")
    shutil.rmtree(work / "tiny-diffusers")
    trt = _profile(work, ["TensorrtExecutionProvider", "CUDAExecutionProvider"])
    _profile(work, ["CUDAExecutionProvider"])
    done = _cli("engines", "build", "--config", str(trt), "--model", str(tiny), "--dry-run")
    if done.returncode != 0:
        raise SystemExit(f"the dry run failed: {done.stderr[-2000:]}")
    (work / "plan.json").write_text(done.stdout)
    print(f"prepared {work} ({sum(p.stat().st_size for p in work.rglob('*') if p.is_file()) / 1e6:.1f} MB)")


def _lora(diffusers_dir: Path, folder: Path) -> None:
    import diffusers

    from tests import lora_files as lf

    pipe = diffusers.StableDiffusionPipeline.from_pretrained(diffusers_dir, safety_checker=None)
    lf.peft_file(folder / "style.safetensors",
                 {"unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=1, scale=0.5),
                  "text_encoder": lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 4, seed=2, scale=0.5)})


def step_options(work: Path) -> str:
    """Every option set of the build plan, and the serving sets, on the real provider libraries."""
    from engines.runtime import optcheck

    plan = json.loads((work / "plan.json").read_text())
    results = []
    for size, entry in plan["sizes"].items():
        for component, spec in entry["components"].items():
            inputs = optcheck.graph_input_types(work / "tiny" / spec["source"])
            results.append((f"{size}/{component}", optcheck.parse(optcheck.TRT, spec["provider_options"], inputs)))
    refused = [f"{k}: {r.detail}" for k, r in results if not r.accepted]
    loaded = sum(r.loaded for _, r in results)
    if refused:
        return f"FAIL {len(refused)} of {len(results)} sets refused by ORT's parser: {'; '.join(refused)[:600]}"
    state = "OK" if loaded == len(results) else "FAIL"
    why = "" if state == "OK" else f" ({results[0][1].detail[:300]})"
    return f"{state} {len(results)} sets accepted by the parser, TensorRT loaded for {loaded}{why}"


def step_build_and_boot(work: Path, samples: list[dict[str, float]]) -> str:
    """`engines build` at 64x64, then a production engine from the artifacts and one image; no on-node build."""
    model = work / "built"
    shutil.rmtree(model, ignore_errors=True)
    shutil.copytree(work / "tiny", model)
    profile = work / "profile-tens-cuda.toml"
    start = time.monotonic()
    done = _cli("engines", "build", "--config", str(profile), "--model", str(model))
    if done.returncode != 0:
        return f"FAIL engines build exit {done.returncode}: {' '.join(done.stderr.split())[-500:]}"
    built_s = time.monotonic() - start
    line = _image(model, profile, samples, None)
    return f"{line}; build {built_s:.0f} s"


def _engine(model: Path, profile: Path, lora_dir: Path | None) -> object:
    from server.bootstrap import BootConfig

    boot = BootConfig.create(model, "production", profile)
    if lora_dir is not None:
        runtime = boot.settings.runtime
        lora = runtime.lora.model_copy(update={"dir": str(lora_dir)})
        settings = boot.settings.model_copy(update={"runtime": runtime.model_copy(update={"lora": lora})})
        boot = BootConfig(model, settings, boot.matrix, boot.plan, boot.faults)
    return boot.engine()


class Sampler:
    """NVML every 0.2 s on a thread while a workload runs (SM %, memory-controller %, W)."""

    def __init__(self, samples: list[dict[str, float]]) -> None:
        import threading

        self.samples, self.stop = samples, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            from engines.health.telemetry import NvmlTelemetry

            telemetry = NvmlTelemetry({0: 0})
        except Exception:  # no NVML here: the signature step says so
            return
        while not self.stop.wait(0.2):
            s = telemetry.sample(0)
            self.samples.append({"sm_percent": s.sm_percent, "memory_percent": s.memory_percent, "w": s.power_w})

    def __enter__(self) -> Sampler:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(5)


def _image(model: Path, profile: Path, samples: list[dict[str, float]], lora_dir: Path | None) -> str:
    from engines.types.request import Batch, ImageSpec

    engine = _engine(model, profile, lora_dir)
    try:
        engine.preflight()  # type: ignore[attr-defined]
        engine.load()  # type: ignore[attr-defined]
        start = time.monotonic()
        with Sampler(samples):
            for seed in range(1, 6):  # a few images, so NVML sees the work
                batch = Batch((ImageSpec("a red cube", seed=seed),), SIZE, SIZE, 20)
                result = engine.generate(batch)  # type: ignore[attr-defined]
        seconds = (time.monotonic() - start) / 5
        caps = engine.capabilities()  # type: ignore[attr-defined]
        providers = {n: s.providers_used[0] for n, s in caps.sessions.items()}
        return f"OK image in {seconds:.2f} s on {result.provider}; sessions {providers}; arena {caps.arena}"
    except Exception as exc:  # the step's line says why; the next step still runs
        return f"FAIL {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
    finally:
        engine.close()  # type: ignore[attr-defined]


def step_lora(work: Path, samples: list[dict[str, float]]) -> str:
    """A CUDA-policy engine on the external-data model with the LoRA folder: audit passes, LoRA image differs."""
    import numpy as np

    from engines.types.request import Batch, ImageSpec, LoraUse

    engine = _engine(work / "tiny-external", work / "profile-cuda.toml", work / "loras")
    try:
        engine.preflight()  # type: ignore[attr-defined]
        engine.load()  # type: ignore[attr-defined]
        memory = [_gpu_memory()]
        listed = {f.name: f for f in engine.loras()}  # type: ignore[attr-defined]
        use = LoraUse("style", listed["style"].sha256, 1.0, 1.0)
        spec = (ImageSpec("a red cube", seed=1),)
        base = engine.generate(Batch(spec, SIZE, SIZE, 20))  # type: ignore[attr-defined]
        lora = engine.generate(Batch(spec, SIZE, SIZE, 20, loras=(use,)))  # type: ignore[attr-defined]
        memory.append(_gpu_memory())
        diff = float(np.abs(np.asarray(base.images[0].image, np.float32)
                            - np.asarray(lora.images[0].image, np.float32)).max())
        state = "OK" if diff > 0 else "FAIL"
        return (f"{state} audit passed, LoRA image max |diff| {diff:.0f}/255 on {lora.provider}; "
                f"memory.used MiB after load/after merge {memory}")
    except Exception as exc:
        return f"FAIL {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
    finally:
        engine.close()  # type: ignore[attr-defined]


def _gpu_memory() -> int:
    done = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=False)
    return int(done.stdout.split()[0]) if done.returncode == 0 and done.stdout.strip() else -1


def step_signature(samples: list[dict[str, float]]) -> str:
    """NVML's three readings that tell computing from spinning: while step 2 generated, and idle now."""
    idle: list[dict[str, float]] = []
    with Sampler(idle):
        time.sleep(2.0)  # a measurement window, not a wait for a state
    if not idle:
        return "FAIL NVML gave no sample (no NVIDIA driver here)"

    def peak(rows: list[dict[str, float]]) -> dict[str, float]:
        return {k: max(r[k] for r in rows) for k in ("sm_percent", "memory_percent", "w")} if rows else {}

    return f"OK busy peak {peak(samples)} over {len(samples)} samples; idle peak {peak(idle)}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=ROOT / ".gpu")
    parser.add_argument("--prepare", type=Path, default=None, help="make the work folder here (CPU, build extra)")
    parser.add_argument("--rehearse", action="store_true", help="no GPU here: steps 2-5 must fail, and say why")
    args = parser.parse_args()
    if args.prepare is not None:
        prepare(args.prepare)
        return 0
    samples: list[dict[str, float]] = []
    steps: list[tuple[str, Callable[[], str]]] = [
        ("options", lambda: step_options(args.work)),
        ("build-and-boot", lambda: step_build_and_boot(args.work, samples)),
        ("lora-external-data", lambda: step_lora(args.work, samples)),
        ("signature", lambda: step_signature(samples))]
    failed = 0
    for n, (name, body) in enumerate(steps, 1):
        start = time.monotonic()
        try:
            line = body()
        except Exception as exc:  # a step never stops the others
            line = f"FAIL {type(exc).__name__}: {' '.join(str(exc).split())[:600]}"
        failed += line.startswith("FAIL")
        print(f"STEP {n} {name}: {line} [{time.monotonic() - start:.1f} s]", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
