"""The seven steps of benchmarks/gpu/device_check.py: what a first GPU node proves with the CUDA provider alone.

Each step takes the run's :class:`Node` and returns ``(status, text)``: "PASS", "FAIL" or "SKIP" and the numbers as
``key=value`` pairs. A step raises when its work does; the caller prints the real cause. With ``rehearse`` the CPU
provider stands in for CUDA (the dev policy, the same code path) and the full-size UNet is built at the tiny size.
"""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from engines.config import RuntimeSettings
from engines.engine import OrtEngine
from engines.types.request import Batch, ImageSpec, LoraUse

CUDA = "CUDAExecutionProvider"
Result = tuple[str, str]
SIZE = 64
"""The tiny model's served size (steps 2, 3, 6)."""
FULL_SIZE, REHEARSE_SIZE = 512, 64
"""Step 5's image size on a GPU, and in the rehearsal (where the UNet is built with the tiny model's widths)."""
NO_DEVICE = "no NVIDIA device"


def nvidia_device_present() -> bool:
    """A device node of the NVIDIA driver exists: the only case a GPU step may SKIP is its absence."""
    return any(Path("/dev").glob("nvidia[0-9]*"))


@dataclass
class Node:
    """What the steps share: the policy, the prepared folder, the engine steps 2-3 load, NVML samples."""

    rehearse: bool
    work: Path
    settings: RuntimeSettings
    device: bool
    engine: OrtEngine | None = None
    busy: list[dict[str, float]] = field(default_factory=list)
    """NVML samples taken while an engine computed (steps 3, 5, 6), for step 7."""

    @property
    def skips_device(self) -> bool:
        """The one case a device step SKIPs: a rehearsal on a machine without an NVIDIA device. Off the rehearsal a
        missing device is a failure, with NVML's or ORT's own words."""
        return self.rehearse and not self.device

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
            self.engine = None


class Sampler:
    """NVML every 0.1 s on a thread while a workload runs (SM %, memory-controller %, W); nothing without a device.
    An NVML failure on a node that has a device is kept and raised by step 7, never read as "no driver"."""

    def __init__(self, node: Node, into: list[dict[str, float]] | None = None) -> None:
        self.node, self.rows = node, node.busy if into is None else into
        self.error: BaseException | None = None
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        try:
            from engines.health.telemetry import NvmlTelemetry

            telemetry = NvmlTelemetry({0: 0})
            while True:
                s = telemetry.sample(0)
                self.rows.append({"sm_percent": s.sm_percent, "memory_percent": s.memory_percent, "w": s.power_w})
                if self.stop.wait(0.1):
                    break
            telemetry.close()
        except BaseException as exc:  # raised again by whoever asks (step 7), with its own words
            self.error = exc

    def __enter__(self) -> Sampler:
        if not self.node.skips_device:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread.is_alive():
            self.thread.join(5)


def _engine(node: Node, model: Path, lora_dir: Path | None = None) -> OrtEngine:
    from engines.config import load_matrix

    settings = node.settings
    if lora_dir is not None:
        settings = settings.model_copy(update={"lora": settings.lora.model_copy(update={"dir": str(lora_dir)})})
    engine = OrtEngine(model, settings, load_matrix(Path(__file__).resolve().parents[2] / "configs" / "matrix.toml"))
    engine.preflight()
    engine.load()
    return engine


def _batch(prompt: str, seed: int, steps: int, size: int = SIZE, guidance: float = 7.5) -> Batch:
    return Batch((ImageSpec(prompt, seed=seed, guidance_scale=guidance, keep_latents=True),), size, size, steps)


def step_preflight(node: Node) -> Result:
    """gather() and evaluate() under the policy: every check's status; TensorRT absent by design."""
    from engines.config import load_matrix
    from engines.health.preflight import evaluate, gather

    obs = gather()
    checks = evaluate(obs, load_matrix(Path(__file__).resolve().parents[2] / "configs" / "matrix.toml"),
                      node.settings)
    counts = {s: sum(c.status == s for c in checks) for s in ("pass", "fail", "skip")}
    closure = obs.closures.get(CUDA)
    libraries = "none (no CUDA provider library)" if closure is None else \
        f"{len(closure.resolved)} resolved, missing {sorted(closure.missing) or 'none'}"
    trt = next((c for c in checks if c.name == "tensorrt_version"), None)
    text = (f"checks pass={counts['pass']} fail={counts['fail']} skip={counts['skip']} ort={obs.ort_version} "
            f"ort_cuda={obs.ort_cuda_version or 'none'} cudnn={obs.cudnn_version or 'none'} "
            f"providers={','.join(obs.available_providers)} cuda_libraries: {libraries}; "
            f"tensorrt={trt.status if trt else 'unchecked'} ({trt.remediation if trt else ''})")
    failed = [f"{c.name}: found {c.observed}, expected {c.expected}" for c in checks if c.status == "fail"]
    if failed:
        return "FAIL", f"{text}; failed: {'; '.join(failed)[:600]}"
    return "PASS", text


def step_engine(node: Node) -> Result:
    """The tiny model's engine under the policy, one image (so the lazy step and row sessions exist), then every
    session's providers and CPU-node count from the placement audit."""
    node.engine = engine = _engine(node, node.work / "model")
    engine.generate(_batch("a red cube", 1, 4))
    sessions = engine.capabilities().sessions
    rows, wrong = [], []
    for name, info in sorted(sessions.items()):
        placement = info.placement
        cpu = placement.nodes_by_provider.get("CPUExecutionProvider", 0) if placement else -1
        used = info.providers_used[0] if info.providers_used else "none"
        rows.append(f"{name}={used.removesuffix('ExecutionProvider')}/cpu_nodes={cpu}")
        if not node.rehearse and (used != CUDA or (placement is not None and not placement.ok)):
            wrong.append(name)
    text = f"sessions={len(sessions)} " + " ".join(rows) + f"; {_fallback_flag(node)}"
    return ("FAIL", f"{text}; not on CUDA or refused by the audit: {wrong}") if wrong else ("PASS", text)


def _fallback_flag(node: Node) -> str:
    """Whether ORT's own ``session.disable_cpu_ep_fallback`` accepts the same engine on CUDA (the CUDA profile
    leaves it off because it may refuse the shape arithmetic CUDA keeps on the CPU: FACTS, unverified on a GPU).
    Informational: the profile's verdict is the placement audit's."""
    if node.rehearse:
        return "fallback_flag_probe=not run (the CPU provider is listed: ORT refuses the flag with it)"
    strict = dataclasses.replace(node, settings=node.settings.model_copy(update={"disable_cpu_ep_fallback": True}),
                                 engine=None)
    try:
        _engine(strict, node.work / "model").close()
    except Exception as exc:
        return f"fallback_flag_probe=refused ({type(exc).__name__}: {' '.join(str(exc).split())[:300]})"
    return "fallback_flag_probe=accepted"


def _ticks(engine: OrtEngine, batches: list[Batch]) -> tuple[list[np.ndarray], float, int]:
    """Run ``batches`` together, one joined call per tick: (each image's final latents, seconds, ticks)."""
    runs = [engine.begin(b) for b in batches]
    latents: dict[int, np.ndarray] = {}
    ticks, start = 0, time.perf_counter()
    running = list(enumerate(runs))
    while running and ticks < 1000:
        engine.tick([r for _, r in running])
        ticks += 1
        for k, run in list(running):
            if run.finished:
                found = engine.finish(run).images[0].latents
                if found is None:
                    raise RuntimeError("the engine returned no latents though keep_latents was set")
                latents[k] = np.asarray(found, np.float32)
                running.remove((k, run))
    return [latents[k] for k in range(len(batches))], time.perf_counter() - start, ticks


JOINED_BOUND_CPU = 1e-3
"""max |delta| of a joined request's latents from its solo run on the CPU: the rows are copied, the kernels the same."""
JOINED_BOUND_GPU = 2e-2
"""On a GPU the kernels chosen per batch size (cuDNN algorithms, TF32 GEMM tiles) may round differently; latents are
of unit scale, so a mixed-up row is far above this and rounding far below."""


def step_joined(node: Node) -> Result:
    """Two requests joined tick by tick vs each alone: max |delta| of the final latents, ms per tick, host reads."""
    engine = node.engine
    if engine is None:
        raise RuntimeError("step 2 did not load the engine")
    batches = [_batch("a lighthouse at dusk", 10, 6), _batch("a forest", 20, 6, guidance=5.0)]
    runtime = engine._pipeline_for(batches[0]).runtime
    with Sampler(node):
        _ticks(engine, batches[:1])  # warm: first-run allocations out of the timing
        solo, solo_s, solo_ticks = [], 0.0, 0
        for batch in batches:
            (one,), seconds, ticks = _ticks(engine, [batch])
            solo.append(one)
            solo_s, solo_ticks = solo_s + seconds, solo_ticks + ticks
        runtime.host_reads.clear()
        joined, joined_s, joined_ticks = _ticks(engine, batches)
        reads = len(runtime.host_reads)
    delta = max(float(np.abs(a - b).max()) for a, b in zip(joined, solo, strict=True))
    syncs = runtime.syncs
    text = (f"max_abs_delta={delta:.3g} ms_per_tick_joined={1000 * joined_s / joined_ticks:.2f} "
            f"ms_per_tick_solo={1000 * solo_s / solo_ticks:.2f} host_reads_per_tick={reads / joined_ticks:.2f} "
            f"ticks={joined_ticks} last_tick_runs={syncs.last_tick_runs} last_tick_syncs={syncs.last_tick_syncs} "
            f"shared_stream={bool(runtime.stream_state.get('shared'))}")
    return ("PASS" if delta <= (JOINED_BOUND_CPU if node.rehearse else JOINED_BOUND_GPU) else "FAIL"), text


ARENA_CAP = 256 << 20
"""The arena cap the probe registers (step 4): small, so "beyond it" is cheap on any card."""


def arena_probe(cap: int) -> int:
    """In a fresh process (the shared arena is registered once per process): register the shared CUDA arena capped
    at ``cap`` bytes as the engine does (engines/runtime/buffers.py device_arena), then allocate half the cap
    (must work) and twice the cap (must fail) through it. Prints one line; exit 0 only when both held."""
    import onnxruntime as ort

    from engines.runtime.buffers import device_arena

    settings = RuntimeSettings(providers=(CUDA,))
    state = device_arena(settings, int(cap / settings.cuda.gpu_mem_limit_fraction) + 1)
    if not state["registered"]:
        print(f"ARENA not registered: {state['error']}")
        return 2
    ort.OrtValue.ortvalue_from_shape_and_type([cap // 2], np.uint8, "cuda", 0)
    try:
        ort.OrtValue.ortvalue_from_shape_and_type([cap * 2], np.uint8, "cuda", 0)
    except Exception as exc:
        print(f"ARENA cap={state['max_mem_bytes']} within=ok beyond=refused ({' '.join(str(exc).split())[:200]})")
        return 0
    print(f"ARENA cap={state['max_mem_bytes']} within=ok beyond=ALLOCATED (the cap did not hold)")
    return 1


def step_arena(node: Node) -> Result:
    """The probe in a child process; in the rehearsal it runs too (and cannot register a CUDA arena)."""
    done = subprocess.run([sys.executable, str(Path(__file__).with_name("device_check.py")), "--arena-probe",
                           str(ARENA_CAP)], capture_output=True, text=True, timeout=120)
    said = (done.stdout.strip().splitlines() or [f"no output; stderr: {done.stderr.strip()[-400:]}"])[-1]
    if node.skips_device:
        return "SKIP", f"{NO_DEVICE} (the probe ran: {said.removeprefix('ARENA ')[:300]})"
    return ("PASS" if done.returncode == 0 else "FAIL"), said.removeprefix("ARENA ")


def _our_ms_per_step(node: Node, model: Path, size: int) -> float:
    """The engine's ms per denoising step with CFG, as serving runs it (begin, one tick per step, finish): the
    median tick of three 8-step requests after a warm-up one (text encoder and VAE are outside the ticks)."""
    engine = _engine(node, model)
    try:
        ticks: list[float] = []
        for k in range(4):
            run = engine.begin(_batch("an astronaut riding a horse", k, 8, size))
            while not run.finished:
                start = time.perf_counter()
                engine.tick([run])
                if k:  # the first request warms up: allocations, cuDNN's algorithm search
                    ticks.append(time.perf_counter() - start)
            engine.finish(run)
        return 1000 * statistics.median(ticks)
    finally:
        engine.close()


def _torch_ms_per_step(diffusers_dir: Path, size: int, cuda: bool) -> tuple[float, str]:
    """diffusers' UNet2DConditionModel on the same weights, one CFG step (batch 2, SDPA), the median after a
    warm-up (10 on the GPU, 3 rehearsing): fp16 on the GPU, fp32 on the CPU (the rehearsal)."""
    import torch
    from diffusers import UNet2DConditionModel

    device, dtype = (torch.device("cuda", 0), torch.float16) if cuda else (torch.device("cpu"), torch.float32)
    unet = UNet2DConditionModel.from_pretrained(diffusers_dir / "unet", torch_dtype=dtype).to(device).eval()
    latents = torch.randn(2, 4, size // 8, size // 8, device=device, dtype=dtype)
    context = torch.randn(2, 77, unet.config.cross_attention_dim, device=device, dtype=dtype)
    times = []
    with torch.inference_mode():
        for k in range(11 if cuda else 4):
            if cuda:
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            unet(latents, torch.tensor(999 - k, device=device), encoder_hidden_states=context)
            if cuda:
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times[1:]), str(dtype).removeprefix("torch.")


def step_fullsize(node: Node) -> Result:
    """SD 1.5's architecture with random weights built here (engines/build/sd15.py; the tiny widths in the
    rehearsal), optimized for the target, then ms per step ours vs diffusers' torch on the same weights."""
    from engines.build import sd15, tiny
    from engines.build.optimize import optimize_folder

    size = REHEARSE_SIZE if node.rehearse else FULL_SIZE
    out, twin, optimized = (node.work / name for name in ("sd15", "sd15-diffusers", "sd15-optimized"))
    start = time.perf_counter()
    bpe = node.work / "bpe_simple_vocab_16e6.txt.gz"
    configs = (tiny.TEXT_ENCODER, tiny.UNET, tiny.VAE) if node.rehearse else None
    sd15.build_sd15(out, twin, bpe=bpe if bpe.is_file() else None, configs=configs)
    built_s = time.perf_counter() - start
    if node.rehearse:  # optimize_folder has its own tests (tests/integration/test_optimize.py); here it would
        served, how = out, "fp32 export, not optimized in the rehearsal"  # double the rehearsal's time
    else:
        optimize_folder(out, optimized, "cuda", fp16=True)
        served, how = optimized, "engines optimize --target cuda --fp16"
    with Sampler(node):
        ours = _our_ms_per_step(node, served, size)
        theirs, dtype = _torch_ms_per_step(twin, size, cuda=not node.rehearse)
    return "PASS", (f"size={size} ours_ms_per_step={ours:.1f} ({how}) torch_ms_per_step={theirs:.1f} ({dtype}) "
                    f"ratio={ours / theirs:.2f} build_s={built_s:.0f}")


def _device_memory_mib(node: Node) -> int:
    """memory.used of device 0 in MiB from NVML; -1 rehearsing without a device (else a failure raises, with its
    cause)."""
    if node.skips_device:
        return -1
    import pynvml

    pynvml.nvmlInit()
    try:
        return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).used) >> 20
    finally:
        pynvml.nvmlShutdown()


def step_lora(node: Node) -> Result:
    """The external-data copy of the tiny model with a LoRA folder, under the policy: the audit passes at load,
    the LoRA image differs from the base image; device memory after load and after the merge."""
    engine = _engine(node, node.work / "tiny-external", node.work / "loras")
    try:
        memory = [_device_memory_mib(node)]
        listed = {f.name: f for f in engine.loras()}
        use = LoraUse("style", listed["style"].sha256, 1.0, 1.0)
        with Sampler(node):
            base = engine.generate(_batch("a red cube", 1, 4))
            lora = engine.generate(Batch(_batch("a red cube", 1, 4).images, SIZE, SIZE, 4, loras=(use,)))
        memory.append(_device_memory_mib(node))
        base_l, lora_l = (np.asarray(r.images[0].latents, np.float32) for r in (base, lora))
        diff = float(np.abs(base_l - lora_l).max())
        text = (f"lora_max_abs_delta={diff:.3g} provider={lora.provider} "
                f"memory_mib_after_load={memory[0]} memory_mib_after_merge={memory[1]}")
        return ("PASS" if diff > 0 else "FAIL"), text
    finally:
        engine.close()


def step_nvml(node: Node) -> Result:
    """NVML's three readings, peak while steps 3, 5 and 6 computed and over one idle second."""
    if node.skips_device:
        return "SKIP", f"{NO_DEVICE}: no /dev/nvidia* node on this machine"
    idle: list[dict[str, float]] = []
    sampler = Sampler(node, idle)
    with sampler:
        time.sleep(1.0)  # a measurement window, not a wait for a state
    if sampler.error is not None:
        raise sampler.error
    if not idle:
        raise RuntimeError(f"NVML gave no sample in one second and no error (device node present: {node.device})")

    def peak(rows: list[dict[str, float]]) -> dict[str, Any]:
        return {k: max(r[k] for r in rows) for k in ("sm_percent", "memory_percent", "w")} if rows else {}

    busy = peak(node.busy)
    text = f"busy_peak={busy} over {len(node.busy)} samples; idle_peak={peak(idle)} over {len(idle)}"
    return ("PASS" if busy else "FAIL"), text
