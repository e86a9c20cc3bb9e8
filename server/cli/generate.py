"""`sdserve generate`: one image to a PNG file, validated like an API request."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from server.cli.common import add_boot_args, boot_config
from server.cli.serve import check_model_folder

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate one image to a PNG file")
    add_boot_args(p)
    p.add_argument("prompt")
    p.add_argument("-o", "--out", type=Path, default=Path("out.png"),
                   help="PNG path; with -n above 1, image i goes to <stem>-<i><suffix>")
    p.add_argument("-n", type=int, default=1, help="images (seeds seed, seed+1, ...)")
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT")
    p.add_argument("--scheduler", default=None, help="sdserve name (euler, dpmpp_2m, ...) or an A1111 sampler "
                                                      "name (\"DPM++ 2M\", \"Euler a\", ...)")
    p.add_argument("--guidance-scale", type=float, default=None)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engines.errors import GpuUnavailableError, InvalidRequestError
    from server.request_rules import build_batch
    from server.schemas import ImageGenerationRequest
    from server.service import encode_png

    check_model_folder(args.model)  # exit 11 for a missing folder, as `serve` does
    boot = boot_config(args)  # every option is checked before anything loads
    try:
        req = ImageGenerationRequest.model_validate(
            {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "seed": args.seed, "steps": args.steps,
             "size": args.size, "scheduler": _scheduler(args.scheduler), "guidance_scale": args.guidance_scale,
             "n": args.n})
    except ValidationError as exc:
        first = exc.errors()[0]
        name = str(first["loc"][0]) if first["loc"] else "prompt"
        raise InvalidRequestError(f"--{name.replace('_', '-')}: {first['msg']}", name) from None
    engine = boot.engine()
    try:
        engine.preflight()
        engine.load()
        result = engine.generate(build_batch(req, boot.settings, engine.info))
    except GpuUnavailableError:
        if args.profile == "production":
            log.error("no usable GPU here: add --profile dev to generate on the CPU (slow, not accelerated)")
        raise
    finally:
        engine.close()
    for index, generated in enumerate(result.images):
        path = args.out if len(result.images) == 1 else args.out.with_name(f"{args.out.stem}-{index}{args.out.suffix}")
        path.write_bytes(encode_png(generated.image))
        log.info("wrote %s (%s, seed %d, %.2fs on %s)", path, generated.image.size, generated.seed,
                 result.timings.total, result.provider)
    return 0


def _scheduler(name: str | None) -> str | None:
    """An A1111 sampler name ("DPM++ 2M", "Euler a") as the API's scheduler name; other names pass through."""
    if name is None:
        return None
    from server.routes.a1111 import sampler_name

    return sampler_name(name) or name
