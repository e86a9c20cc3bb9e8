"""`sdserve engines ...`: build, export, optimize, quantize and TensorRT-build models (build-time commands)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from server.cli import _engine, _settings

log = logging.getLogger("sdserve")


def engines_command(args: argparse.Namespace) -> int:
    import json

    if args.engines_cmd == "tiny":
        from engines.build.tiny import build_tiny

        out = build_tiny(args.out, args.bpe, args.diffusers_out)
    elif args.engines_cmd == "export":
        from engines.build.export import export_folder

        out = export_folder(args.src, args.out)
    elif args.engines_cmd == "optimize":
        from engines.build.optimize import optimize_folder

        report = optimize_folder(args.model, args.out, args.target, args.fp16, vae_fp32=not args.vae_fp16)
        print(json.dumps(report, indent=2))
        out = args.out
    elif args.engines_cmd == "quantize":
        from engines.build.quantize import quantize
        from engines.selftest import Shape, load_canaries
        from server.settings import config_path

        size = _native_size(args.model)
        gate = quantize(args.model, args.out, load_canaries(config_path("canaries.toml")), Shape(size, size, 2),
                        args.max_distance)
        print(json.dumps(gate, indent=2))
        out = args.out
    else:
        return _build_engines(args)
    log.info("model written to %s (manifest.json lists every file's sha256)", out)
    return 0


def _native_size(model: Path) -> int:
    import json

    unet = json.loads((model / "unet" / "config.json").read_text()) if (model / "unet" / "config.json").is_file() \
        else {}
    vae = json.loads((model / "vae_decoder" / "config.json").read_text()) \
        if (model / "vae_decoder" / "config.json").is_file() else {}
    factor: int = 2 ** (len(vae.get("block_out_channels", [0] * 4)) - 1)
    return int(unet.get("sample_size", 64)) * factor


def _build_engines(args: argparse.Namespace) -> int:
    import json

    from engines import trtplan
    from server.settings import parse_size

    settings = _settings(args)
    sizes = [parse_size(s) for s in settings.serving.sizes] or [(_native_size(args.model),) * 2]
    flags = trtplan.BuildFlags(fp16=settings.runtime.tensorrt.fp16, int8=args.int8,
                               builder_optimization_level=args.opt_level)
    plan = trtplan.plan(args.model, trtplan.profiles_from(sizes, settings.serving.batch_sizes), flags,
                        settings.runtime.device_id)
    if args.dry_run:
        print(json.dumps(plan, indent=2))
        return 0
    from engines.build.trt_build import build, require_int8_gate

    if args.int8:
        require_int8_gate(args.model)
    engine = _engine(args, settings.model_copy(update={"runtime": settings.runtime.model_copy(
        update={"providers": ("TensorrtExecutionProvider", "CUDAExecutionProvider"), "allow_cpu": False})}))
    engine.preflight()
    manifest = build(args.model, plan, engine.capabilities()["observations"], settings.runtime.device_id)
    log.info("engines and manifest written: %s", manifest)
    return 0
