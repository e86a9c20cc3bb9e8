"""`sdserve generate`: one image to a PNG file, validated like an API request."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from server.cli.common import add_boot_args, boot_config

log = logging.getLogger("sdserve")


def register(sub: Any) -> None:
    p = sub.add_parser("generate", help="generate one image to a PNG file")
    add_boot_args(p)
    p.add_argument("prompt")
    p.add_argument("-o", "--out", type=Path, default=Path("out.png"))
    p.add_argument("--negative-prompt", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=None)
    p.add_argument("--size", default=None, help="WIDTHxHEIGHT")
    p.add_argument("--scheduler", default=None)
    p.add_argument("--guidance-scale", type=float, default=None)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from engines.errors import InvalidRequestError
    from server.schemas import ImageGenerationRequest
    from server.service import build_batch, encode_png

    boot = boot_config(args)
    try:
        req = ImageGenerationRequest.model_validate(
            {"prompt": args.prompt, "negative_prompt": args.negative_prompt, "seed": args.seed, "steps": args.steps,
             "size": args.size, "scheduler": args.scheduler, "guidance_scale": args.guidance_scale})
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidRequestError(f"--{first['loc'][0]}: {first['msg']}", str(first["loc"][0])) from None
    engine = boot.engine()
    engine.preflight()
    engine.load()
    try:
        result = engine.generate(build_batch(req, boot.settings, engine.info))
        args.out.write_bytes(encode_png(result.images[0].image))
    finally:
        engine.close()
    log.info("wrote %s (%s, %.2fs on %s)", args.out, result.images[0].image.size, result.timings.total,
             result.provider)
    return 0
