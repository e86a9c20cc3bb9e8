"""`sdserve` command line: serve, generate, engines tiny/export. The one place errors become exit codes."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engines.errors import ConfigError, InvalidRequestError, SdserveError
from server.exitcodes import ExitCode, exit_code_for
from server.settings import Settings, load_settings

if TYPE_CHECKING:
    from engines.engine import OrtEngine
    from engines.faults import FaultInjector
    from engines.telemetry import TelemetrySource

log = logging.getLogger("sdserve")
DEFAULT_MODEL = Path("models/tiny")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--profile", choices=["dev", "production"], default="production",
                   help="settings profile from configs/ (default: production)")
    p.add_argument("--config", type=Path, default=None, help="a profile TOML file instead of configs/<profile>.toml")
    p.add_argument("--model", type=Path, default=Path(os.environ.get("SDSERVE_MODEL", DEFAULT_MODEL)),
                   help="ONNX model folder (env SDSERVE_MODEL; default models/tiny)")
    p.add_argument("--device-id", type=int, default=None, help="CUDA device this process serves")
    p.add_argument("--matrix", type=Path, default=None, help="version matrix TOML (default: configs/matrix.toml)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="sdserve", description=__doc__)
    parser.add_argument("--log-level", default=os.environ.get("SDSERVE_LOG_LEVEL", "INFO"))
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the HTTP API")
    _common(serve)
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None, help="0 picks a free port and logs it")
    doctor = sub.add_parser("doctor", help="preflight + session build + placement audit, without serving")
    _common(doctor)
    doctor.add_argument("--json", action="store_true", help="print the capability snapshot as JSON")
    doctor.add_argument("--watch", type=float, default=0.0, metavar="N",
                        help="sample NVML for N seconds and classify the GPU signature")
    bench = sub.add_parser("bench", help="load-test a running sdserve on this machine")
    bench.add_argument("--url", default="http://127.0.0.1:8000")
    bench.add_argument("--concurrency", default="1,4,8,16,32", help="comma-separated levels")
    bench.add_argument("--requests", type=int, default=64, help="requests per level (bound)")
    bench.add_argument("--max-seconds", type=float, default=120.0, help="time bound per level")
    bench.add_argument("--size", default="64x64")
    bench.add_argument("--steps", type=int, default=20)
    bench.add_argument("--out", type=Path, default=Path("bench.json"))
    bench.add_argument("--plot", type=Path, default=None, help="PNG: latency and throughput vs concurrency")
    bench.add_argument("--api-key-env", default="SDSERVE_API_KEY", help="environment variable holding the key")
    deploy = sub.add_parser("deploy", help="render Kubernetes manifests and the Grafana dashboard")
    render = deploy.add_subparsers(dest="deploy_cmd", required=True).add_parser("render")
    render.add_argument("--profile", choices=["dev", "production"], default="production")
    render.add_argument("--config", type=Path, default=None)
    render.add_argument("--matrix", type=Path, default=None)
    render.add_argument("--image", default="sdserve:0.1.0")
    render.add_argument("--color", default="blue", help="this deployment's blue-green color")
    render.add_argument("--active", default="blue", help="the color the Service sends traffic to")
    render.add_argument("--startup-budget-s", type=int, default=900, help="boot + self-test budget of the probe")
    render.add_argument("--out", type=Path, default=Path("deploy/k8s"))
    render.add_argument("--dashboard", type=Path, default=Path("deploy/grafana/sdserve.json"))
    gate = sub.add_parser("gate", help="compare two bench results; exit non-zero on regression")
    gate.add_argument("--baseline", type=Path, required=True)
    gate.add_argument("--candidate", type=Path, required=True)
    gate.add_argument("--p95-tolerance", type=float, default=0.10, help="allowed p95 increase (fraction)")
    gate.add_argument("--throughput-tolerance", type=float, default=0.10, help="allowed throughput drop")
    gate.add_argument("--fingerprint-tolerance", type=float, default=4.0, help="pixel units, 8x8 thumbnails")
    st = sub.add_parser("selftest", help="run the boot self-test, or record canary fingerprints next to the model")
    _common(st)
    st.add_argument("--record", action="store_true", help="write <model>/selftest.json from this node's outputs")
    gen = sub.add_parser("generate", help="generate one image to a PNG file")
    _common(gen)
    gen.add_argument("prompt")
    gen.add_argument("-o", "--out", type=Path, default=Path("out.png"))
    gen.add_argument("--negative-prompt", default="")
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--steps", type=int, default=None)
    gen.add_argument("--size", default=None, help="WIDTHxHEIGHT")
    gen.add_argument("--scheduler", default=None)
    gen.add_argument("--guidance-scale", type=float, default=None)
    engines = sub.add_parser("engines", help="build and export models").add_subparsers(dest="engines_cmd",
                                                                                       required=True)
    tiny = engines.add_parser("tiny", help="build the embedded tiny SD model (random weights)")
    tiny.add_argument("--out", type=Path, default=DEFAULT_MODEL)
    tiny.add_argument("--bpe", type=Path, default=None, help="open-clip-torch wheel or its bpe .txt.gz")
    tiny.add_argument("--diffusers-out", type=Path, default=None, help="also save the torch weights here")
    export = engines.add_parser("export", help="export a local diffusers SD 1.x/2.x folder to ONNX")
    export.add_argument("--from", dest="src", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True)
    opt = engines.add_parser("optimize", help="ORT transformer-optimizer fusions (+ fp16) into a new folder")
    opt.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    opt.add_argument("--out", type=Path, required=True)
    opt.add_argument("--target", choices=["cpu", "cuda"], default="cpu", help="cuda enables CUDA-only fused ops")
    opt.add_argument("--fp16", action="store_true", help="convert to fp16 (fp32 keep-list for overflow-prone ops)")
    opt.add_argument("--vae-fp16", action="store_true", help="also convert the VAE (kept fp32 by default)")
    build = engines.add_parser("build", help="TensorRT engines for the profile's served shapes (GPU node)")
    _common(build)
    build.add_argument("--dry-run", action="store_true", help="print the provider options and artifact plan")
    build.add_argument("--int8", action="store_true", help="INT8 engines (needs a passed accuracy gate)")
    build.add_argument("--opt-level", type=int, default=3, choices=range(0, 6), help="TensorRT builder level")
    quant = engines.add_parser("quantize", help="INT8 UNet weights behind the canary accuracy gate")
    quant.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    quant.add_argument("--out", type=Path, required=True)
    quant.add_argument("--max-distance", type=float, default=8.0, help="bound on canary fingerprint distance")
    return parser


def _settings(args: argparse.Namespace) -> Settings:
    """The profile with command-line overrides of deployment settings, validated again (bounds apply)."""
    from pydantic import ValidationError

    data = load_settings(args.profile, args.config).model_dump()
    for key in ("host", "port"):
        if getattr(args, key, None) is not None:
            data["server"][key] = getattr(args, key)
    if args.device_id is not None:
        data["runtime"]["device_id"] = args.device_id
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"command-line override: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


def _engine(args: argparse.Namespace, settings: Settings, faults: FaultInjector | None = None) -> OrtEngine:
    from engines.engine import OrtEngine
    from server.settings import selftest_plan, settings_matrix

    return OrtEngine(args.model, settings.runtime, settings_matrix(settings, args.matrix), selftest_plan(settings),
                     faults)


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engines.faults import FaultInjector
    from engines.ortlog import StderrTee
    from server.app import create_app

    settings = _settings(args)
    if settings.runtime.allow_cpu:
        log.warning("profile %s allows the CPU: this server is NOT accelerated (accelerated: false)",
                    settings.profile)
    exit_code = [ExitCode.OK]
    holder: list[uvicorn.Server] = []

    def on_fatal(code: ExitCode, reason: str) -> None:
        exit_code[0] = code
        holder[0].should_exit = True

    faults = FaultInjector() if settings.debug.fault_injection else None
    if faults is not None:
        log.warning("fault injection enabled (dev profile): PUT /debug/faults can slow this server down")
    tee = StderrTee()
    app = create_app(_engine(args, settings, faults), settings, on_fatal, _telemetry(settings), tee, faults)
    config = uvicorn.Config(app, host=settings.server.host, port=settings.server.port, log_level="warning",
                            access_log=False, lifespan="on")
    server = _server_class()(config)
    server.drain_app = app
    holder.append(server)
    _announce_port(server)
    tee.start()
    try:
        server.run()
    finally:
        tee.stop()
    return int(exit_code[0])


def _telemetry(settings: Settings) -> TelemetrySource | None:
    """NVML for GPU profiles (preflight has already proven it starts); none on the CPU."""
    if settings.runtime.device != "cuda":
        return None
    try:
        from engines.telemetry import NvmlTelemetry

        return NvmlTelemetry()
    except Exception as exc:  # pynvml's NVMLError family; preflight reports the cause with its exit code
        log.error("NVML unavailable for the watchdog: %s", exc)
        return None


def _server_class() -> type[Any]:
    import uvicorn

    class Server(uvicorn.Server):
        """SIGTERM/SIGINT drain first (/ready 503 at once, queued work finishes within the drain timeout), then
        shut down; the process exits with our code (0 when healthy) instead of uvicorn re-raising the signal.
        A second signal stops at once."""

        drain_app: Any = None
        _draining: asyncio.Task[None] | None = None

        def handle_exit(self, sig: int, frame: object) -> None:
            if self._draining is not None or self.drain_app is None:
                if self.should_exit and sig == signal.SIGINT:
                    self.force_exit = True
                self.should_exit = True
                return
            loop = asyncio.get_event_loop()
            loop.call_soon_threadsafe(self._start_drain, loop)

        def _start_drain(self, loop: asyncio.AbstractEventLoop) -> None:
            self._draining = loop.create_task(self._drain_then_exit())

        async def _drain_then_exit(self) -> None:
            from server.app import drain

            try:
                await drain(self.drain_app)
            finally:
                self.should_exit = True

    return Server


def _announce_port(server: object) -> None:
    """Log the bound address once uvicorn has started (port 0 picks a free port)."""
    original = server.startup  # type: ignore[attr-defined]

    async def startup(sockets=None):  # type: ignore[no-untyped-def]
        await original(sockets=sockets)
        for srv in getattr(server, "servers", []):
            for sock in srv.sockets:
                host, port = sock.getsockname()[:2]
                log.info("sdserve listening on http://%s:%d", host, port)

    server.startup = startup  # type: ignore[attr-defined]


def _bench(args: argparse.Namespace) -> int:
    from server import bench

    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    if not levels or any(c < 1 or c > 256 for c in levels) or not 1 <= args.requests <= 10_000:
        raise InvalidRequestError("--concurrency levels must be 1..256 and --requests 1..10000", "concurrency")
    result = asyncio.run(bench.bench(args.url, levels, args.requests, args.max_seconds, args.size, args.steps,
                                     os.environ.get(args.api_key_env)))
    bench.write(result, args.out)
    for level in result["levels"]:
        log.info("c=%-3d ok %d/%d  429 %d  errors %d  p50 %s p95 %s p99 %s  %.1f images/min", level["concurrency"],
                 level["ok"], level["requests"], level["rejected_429"], level["errors"], level["p50_s"],
                 level["p95_s"], level["p99_s"], level["images_per_minute"])
    if args.plot is not None and not bench.plot(result, args.plot):
        log.warning("matplotlib is not installed: no plot written")
    return 0


def _deploy(args: argparse.Namespace) -> int:
    from server import deploy
    from server.settings import settings_matrix

    settings = load_settings(args.profile, args.config)
    rendered = deploy.render(settings, settings_matrix(settings, args.matrix), args.image, args.color, args.active,
                             args.startup_budget_s)
    for path in [*deploy.write(args.out, rendered), deploy.write_dashboard(args.dashboard)]:
        log.info("wrote %s", path)
    return 0


def _gate(args: argparse.Namespace) -> int:
    from server import gate

    tol = gate.Tolerances(args.p95_tolerance, args.throughput_tolerance, fingerprint=args.fingerprint_tolerance)
    rows = gate.compare(gate.load(args.baseline), gate.load(args.candidate), tol)
    print(gate.render(rows))
    return int(ExitCode.GATE_REGRESSION) if any(r.verdict == "REGRESSION" for r in rows) else 0


def _selftest(args: argparse.Namespace) -> int:
    import json

    settings = _settings(args)
    engine = _engine(args, settings)
    engine.preflight()
    engine.load()
    try:
        if args.record:
            path = engine.record_fingerprints()
            log.info("recorded canary fingerprints to %s", path)
        else:
            print(json.dumps(engine.self_test(), indent=2))
    finally:
        engine.close()
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from server.doctor import doctor

    settings = _settings(args)
    return doctor(args, settings, _engine(args, settings))


def _generate(args: argparse.Namespace) -> int:
    from server.schemas import ImageGenerationRequest
    from server.service import build_batch, encode_png

    settings = _settings(args)
    engine = _engine(args, settings)
    engine.preflight()
    engine.load()
    from pydantic import ValidationError

    try:
        req = ImageGenerationRequest.model_validate(
            {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "seed": args.seed, "steps": args.steps,
             "size": args.size, "scheduler": args.scheduler, "guidance_scale": args.guidance_scale})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequestError(f"--{first['loc'][0]}: {first['msg']}", str(first["loc"][0])) from None
    result = engine.generate(build_batch(req, settings, engine.info))
    args.out.write_bytes(encode_png(result.images[0].image))
    log.info("wrote %s (%s, %.2fs on %s)", args.out, result.images[0].image.size, result.timings["total"],
             result.provider)
    engine.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for noisy in ("httpx", "httpcore", "matplotlib"):  # one line per request is noise in a load test
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from server.cli_engines import engines_command  # imports back from this module: resolved at call time

    commands = {"serve": _serve, "generate": _generate, "engines": engines_command, "doctor": _doctor,
                "selftest": _selftest, "bench": _bench, "gate": _gate, "deploy": _deploy}
    try:
        return commands[args.command](args)
    except SdserveError as exc:
        code = exit_code_for(exc)
        log.error("%s (exit code %d %s)", exc, code, code.name)
        return int(code)
    except FileNotFoundError as exc:
        log.error("%s", exc)
        return int(ExitCode.MODEL_INVALID)


if __name__ == "__main__":
    sys.exit(main())
