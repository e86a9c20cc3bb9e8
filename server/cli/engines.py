"""`sdserve engines ...`: build, export, optimize, quantize and TensorRT-build models (build-time commands)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

import engines.families as families
from server.cli.common import DEFAULT_MODEL, add_boot_args, boot_config

DIT_FAMILIES = families.names("transformer")
"""The flow-matching DiT tiny models (engines/build/dit.py); kept here so the parser imports no engine code."""

EXPORT_DTYPES = ("fp32", "fp16", "bf16")
"""`engines export --dtype` (engines/build/dit_export.py DTYPES; kept here so the parser imports no engine code)."""

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    engines = sub.add_parser("engines", help="build and export models").add_subparsers(dest="engines_cmd",
                                                                                       required=True)
    tiny = engines.add_parser("tiny", help="build the embedded tiny SD model (random weights)")
    tiny.add_argument("--out", type=Path, default=DEFAULT_MODEL)
    tiny.add_argument("--bpe", type=Path, default=None, help="open-clip-torch wheel or its bpe .txt.gz")
    tiny.add_argument("--diffusers-out", type=Path, default=None, help="also save the torch weights here")
    tiny.add_argument("--family", choices=(*families.names("unet"), "inpaint", *DIT_FAMILIES),
                      default=families.names()[0],
                      help="which family's structure to build in miniature (default sd1, the embedded model; "
                           "flux, flux-schnell, sd3, sd35: the flow-matching DiT families)")
    tiny.add_argument("--variant", default="",
                      help="a released configuration the family also serves: qwen-image-edit 2511 (zero_cond_t); "
                           "default the family's first")
    tiny.add_argument("--controlnet", type=Path, default=None, metavar="DIR",
                      help="sd1 and sdxl: also a tiny ControlNet exported to DIR and the UNet's residual variant "
                           "(unet_controlnet/) in the model; --diffusers-out gets its weights in controlnet/")
    export = engines.add_parser("export", help="export a local diffusers SD 1.x/2.x/XL, Flux.1 or SD 3 folder to ONNX")
    export.add_argument("--from", dest="src", type=Path, required=True)
    export.add_argument("--out", type=Path, required=True)
    export.add_argument("--dtype", choices=EXPORT_DTYPES, default="fp32",
                        help="Flux/SD 3 only: fp16 or bf16 networks (T5's fp32 keeps and Flux's fp16 clamps kept, "
                             "graph inputs/outputs fp32; docs/families.md); SD 1.x/2.x/XL: fp32, then "
                             "`engines optimize --fp16`")
    export.add_argument("--controlnet", action="store_true",
                        help="--from a diffusers ControlNet folder: export it alone; --from an SD 1.x/2.x/XL folder: "
                             "the model plus the UNet's residual variant (unet_controlnet/)")
    export.add_argument("--first-block", action="store_true",
                        help="Flux/SD 3 only: also the transformer in parts for the first-block step cache "
                             "(transformer_first/, transformer_rest/, transformer_skip/: the transformer's weights "
                             "a second time on disk)")
    opt = engines.add_parser("optimize", help="ORT transformer-optimizer fusions (+ fp16) into a new folder")
    opt.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    opt.add_argument("--out", type=Path, required=True)
    opt.add_argument("--target", choices=["cpu", "cuda", "tensorrt"], default="cpu",
                     help="cuda: fused attention + CUDA-only fused ops; tensorrt: standard ONNX only")
    opt.add_argument("--fp16", action="store_true", help="convert to fp16 (fp32 keep-list for overflow-prone ops)")
    opt.add_argument("--vae-fp16", action="store_true", help="also convert the VAE (kept fp32 by default)")
    build = engines.add_parser("build", help="EP-context artifacts for the profile's served shapes: TensorRT engines "
                                             "(GPU node), or the profile's plugin EP (e.g. --profile openvino)")
    add_boot_args(build)
    build.add_argument("--dry-run", action="store_true", help="print the provider options and artifact plan")
    build.add_argument("--int8", action="store_true", help="INT8 engines (needs a passed accuracy gate)")
    build.add_argument("--opt-level", type=int, default=3, choices=range(0, 6), help="TensorRT builder level")
    build.add_argument("--opt-batch", type=int, default=None,
                       help="batch the engines are tuned for (default: the largest of serving.batch_sizes)")
    build.add_argument("--controlnet-dir", type=Path, default=None, metavar="DIR",
                       help="also plan/build the ControlNets of DIR for the model (default [runtime.controlnet] dir)")
    quant = engines.add_parser("quantize", help="INT8 UNet weights behind the canary accuracy gate")
    quant.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    quant.add_argument("--out", type=Path, required=True)
    quant.add_argument("--max-distance", type=float, default=8.0, help="bound on canary fingerprint distance")
    for p in (tiny, export, opt, build, quant):
        p.set_defaults(run=run)


DIFFUSERS_PARTS = ("model_index.json", "text_encoder/config.json", "unet/config.json", "vae/config.json")
"""What a diffusers Stable Diffusion folder has (save_pretrained's layout) and `engines export` reads."""


def check_diffusers_folder(src: Path) -> None:
    """Exit 11 (MODEL_INVALID), naming what is wrong, for an export source that is not a diffusers folder: missing,
    an sdserve ONNX model already (models/tiny), or lacking the parts export reads."""
    from engines.errors import ModelLoadError

    if not src.is_dir():
        raise ModelLoadError(f"--from {src}: not a folder (give a local diffusers Stable Diffusion folder)")
    if (src / "manifest.json").exists() or (src / "unet" / "model.onnx").exists():
        raise ModelLoadError(f"--from {src}: this is an sdserve ONNX model folder already (serve it with "
                             f"`sdserve serve --model {src}`); export reads a diffusers folder (text_encoder/, "
                             "unet/, vae/ with their config.json and weights)")
    missing = [part for part in DIFFUSERS_PARTS if not (src / part).is_file()]
    if missing:
        raise ModelLoadError(f"--from {src}: not a diffusers Stable Diffusion folder, missing {missing}")


def _check_tiny(args: argparse.Namespace) -> None:
    """``engines tiny``'s options that only some families take, refused by name before anything is built."""
    from engines.errors import ConfigError

    if getattr(args, "controlnet", None) is not None:
        from engines.build.controlnet import TINY_FAMILIES
        from engines.build.controlnet_dit import TINY_FLUX_FAMILIES

        if args.family not in (*TINY_FAMILIES, *TINY_FLUX_FAMILIES):
            raise ConfigError(f"--controlnet: a tiny ControlNet is built for "
                              f"{', '.join((*TINY_FAMILIES, *TINY_FLUX_FAMILIES))} only, not {args.family}")
    if args.variant and args.family not in DIT_FAMILIES:
        raise ConfigError(f"--variant: {args.family} has no tiny variants (qwen-image-edit: 2511)")


def _export_dit(args: argparse.Namespace) -> Path:
    """``engines export`` of a diffusers DiT folder; with ``--controlnet`` (FLUX.1 only) the transformer's residual
    variant beside it (engines/build/controlnet_dit.py)."""
    import json

    from engines.build.dit_export import export_dit_folder

    dtype, controlnet = getattr(args, "dtype", "fp32"), getattr(args, "controlnet", False)
    if controlnet and json.loads((args.src / "transformer" / "config.json").read_text(encoding="utf-8")).get(
            "_class_name") != "FluxTransformer2DModel":
        from engines.errors import ConfigError

        raise ConfigError(f"--controlnet: {args.src} is not a FLUX.1 folder; ControlNets are served on SD 1.x/2.x, "
                          "SDXL and FLUX.1 models")
    out: Path = export_dit_folder(args.src, args.out, dtype, getattr(args, "first_block", False))
    if controlnet:
        from engines.build.controlnet_dit import export_controlled_flux_folder

        export_controlled_flux_folder(args.src, out, dtype)
    return out


def _tiny(args: argparse.Namespace) -> Path:
    """``engines tiny``: the family's tiny model (a DiT's from engines/build/dit.py), with ``--controlnet`` its tiny
    ControlNet and the denoiser's residual variant."""
    _check_tiny(args)
    if args.family in DIT_FAMILIES:
        from engines.build.dit import build_tiny_dit

        out: Path = build_tiny_dit(args.family, args.out, args.bpe, args.diffusers_out, variant=args.variant)
    else:
        from engines.build.tiny import build_tiny

        out = build_tiny(args.out, args.bpe, args.diffusers_out, args.family)
    if getattr(args, "controlnet", None) is not None:
        from engines.build.controlnet import build_tiny_controlnet

        build_tiny_controlnet(args.controlnet, out, args.diffusers_out / "controlnet" if args.diffusers_out else None)
    return out


def run(args: argparse.Namespace) -> int:
    import json

    if args.engines_cmd == "tiny":
        out = _tiny(args)
    elif args.engines_cmd == "export" and getattr(args, "controlnet", False) \
            and not (args.src / "model_index.json").is_file():
        from engines.build.controlnet import export_controlnet_folder

        out = export_controlnet_folder(args.src, args.out, getattr(args, "dtype", "fp32"))
    elif args.engines_cmd == "export" and _dit_source(args.src):
        out = _export_dit(args)
    elif args.engines_cmd == "export":
        from engines.build.export import export_folder

        check_diffusers_folder(args.src)
        _unet_dtype(getattr(args, "dtype", "fp32"))
        out = export_folder(args.src, args.out)
        if getattr(args, "controlnet", False):
            from engines.build.controlnet import export_controlled_unet_folder

            export_controlled_unet_folder(args.src, out)
    elif args.engines_cmd == "optimize":
        from engines.build.optimize import optimize_folder

        report = optimize_folder(args.model, args.out, args.target, args.fp16, vae_fp32=not args.vae_fp16)
        print(json.dumps(report, indent=2))
        out = args.out
    elif args.engines_cmd == "quantize":
        from engines.build.quantize import quantize
        from engines.config import Shape, load_canaries
        from server.bootstrap import config_path

        size = _native_size(args.model)
        gate = quantize(args.model, args.out, load_canaries(config_path("canaries.toml")), Shape(size, size, 2),
                        args.max_distance)
        print(json.dumps(gate, indent=2))
        out = args.out
    else:
        return _build_engines(args)
    log.info("model written to %s (manifest.json lists every file's sha256 and size)", out)
    return 0


def _unet_dtype(dtype: str) -> None:
    """The UNet families export fp32 only (ConfigError, exit 10, otherwise): their half precision is
    `sdserve engines optimize --fp16`, which converts with an fp32 keep-list and checks the output difference."""
    from engines.errors import ConfigError

    if dtype != "fp32":
        raise ConfigError(f"--dtype {dtype}: SD 1.x/2.x/XL folders export in fp32; convert the export with "
                          "`sdserve engines optimize --fp16` (--dtype is for Flux and SD 3 folders)")


def _dit_source(src: Path) -> bool:
    """Whether ``--from`` names a Flux/SD 3 pipeline (served or refused by name), from its model_index.json."""
    from engines.build.dit_export import is_dit_source

    return is_dit_source(src)


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

    from engines.build import trt_build, trtplan
    from engines.config import parse_size

    boot = boot_config(args)
    settings = boot.settings
    if settings.runtime.plugin is not None:
        return _build_plugin(args, boot)
    if "TensorrtExecutionProvider" not in settings.runtime.providers:
        from engines.errors import ConfigError

        raise ConfigError(f"profile {settings.profile!r} has no TensorRT in runtime.providers "
                          f"({', '.join(settings.runtime.providers)}): it serves the ONNX graphs themselves, there "
                          f"are no engines to build; run `sdserve engines optimize --model {args.model} --target cuda`")
    # Refused before anything else, dry runs included: a plan for a graph TensorRT cannot import is no plan.
    trtplan.refuse_unimportable(args.model)
    if args.int8:
        from engines.build.trt_build import require_int8_gate

        require_int8_gate(args.model)
    sizes = [parse_size(s) for s in settings.serving.sizes] or [(_native_size(args.model),) * 2]
    # The engine takes every batch the server can form: the batcher's max_batch, one request's max_n, the warmed sizes.
    served = settings.serving.batch_sizes
    batch_max = max(settings.queue.max_batch, settings.limits.max_n, *served)
    flags = trtplan.BuildFlags(fp16=settings.runtime.tensorrt.fp16, int8=args.int8,
                               builder_optimization_level=args.opt_level)
    profiles = trtplan.profiles_from(sizes, batch_max, args.opt_batch or max(served))
    plan = trtplan.plan(args.model, profiles, flags, settings.runtime.device_id)
    # Every option set through ORT's real parser, dry runs included: a key it refuses builds nothing anywhere.
    verdicts = trt_build.parser_verdicts(args.model, plan)
    from engines.build import trtplan_controlnet  # the ControlNets' plans beside the model's (--controlnet-dir)
    from server.cli.serve import with_controlnet_dir

    net_dir = with_controlnet_dir(settings, args.controlnet_dir).runtime.controlnet.dir
    nets = trtplan_controlnet.folder_plans(Path(net_dir), args.model, profiles, flags,
                                           settings.runtime.device_id) if net_dir else {}
    if args.dry_run:
        print(json.dumps(plan | {"option_parser": verdicts} | nets, indent=2))
    trt_build.require_parsed(verdicts | trtplan_controlnet.verdicts(nets))
    if args.dry_run:
        return 0
    log.info("option parser: %d TensorRT option sets of the plan accepted by ONNX Runtime's parser (%s)",
             len(verdicts), ", ".join(sorted(verdicts)))
    _require_node_holds(args.model, len(profiles))
    return _build_on_gpu(args, boot, plan, nets, Path(net_dir or "."))


def _require_node_holds(model: Path, sizes: int) -> None:
    """A DiT folder's build refused by name (exit 23) before it starts when this node's host RAM or free disk
    cannot hold it (engines/health/build_memory.py: a Qwen-Image transformer peaks at ~3x its 38 GiB)."""
    from engines.factory import dit_build_estimate, require_build_fits

    found = dit_build_estimate(model, sizes)
    if found is not None:
        readings = require_build_fits(found, model)
        log.info("build estimate: host RAM peak %.1f GiB of %.1f GiB, disk %.1f GiB of %.1f GiB free",
                 found.host_peak / (1 << 30), readings["host_ram"] / (1 << 30), found.disk_total / (1 << 30),
                 readings["free_disk"] / (1 << 30))


def _build_on_gpu(args: argparse.Namespace, boot: Any, plan: dict[str, Any], nets: dict[str, Any],
                  net_dir: Path) -> int:
    from dataclasses import replace

    from engines.build.trt_build import build

    settings = boot.settings
    gpu = settings.runtime.model_copy(update={"providers": ("TensorrtExecutionProvider", "CUDAExecutionProvider"),
                                              "allow_cpu": False})
    engine = replace(boot, settings=settings.model_copy(update={"runtime": gpu})).engine()
    engine.preflight()
    observations = engine.capabilities().observations
    # The manifest binds the engines to the served card by its NVML index, matched by PCI bus id (never the ordinal).
    manifest = build(args.model, plan, observations.model_dump() if observations else {}, engine.nvml_index())
    log.info("engines and manifest written: %s", manifest)
    if nets:
        from engines.build.trtplan_controlnet import build as build_nets

        written = build_nets(nets, net_dir, observations.model_dump() if observations else {}, engine.nvml_index())
        log.info("ControlNet engines and manifests written: %s", ", ".join(map(str, written)) or "none")
    return 0


def _build_plugin(args: argparse.Namespace, boot: Any) -> int:
    """EP-context artifacts for the profile's plugin EP (engines/build/epctx.py), after the profile's preflight
    (the plugin registers, at the version the matrix pins)."""
    import json

    from engines.build import epctx
    from engines.config import parse_size

    settings = boot.settings
    native = _native_size(args.model)
    sizes = [f"{w}x{h}" for w, h in map(parse_size, settings.serving.sizes)] or [f"{native}x{native}"]
    plugin = settings.runtime.plugin
    if args.dry_run:
        print(json.dumps(epctx.plan(args.model, plugin, sizes), indent=2))
        return 0
    engine = boot.engine()
    engine.preflight()
    observations = engine.capabilities().observations
    manifest = epctx.build(args.model, settings.runtime, sizes, observations.model_dump() if observations else {})
    log.info("EP-context artifacts and manifest written: %s", manifest)
    return 0
