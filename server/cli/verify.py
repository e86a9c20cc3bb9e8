"""`sdserve verify IMAGE...`: what each image's C2PA manifest says, and whether it validates against a trust list.

Exit codes (the worst image decides): 0 every image's manifest validates and its signer chains to ``--trust``;
40 (VERIFY_UNTRUSTED) a manifest validates but its signer is not in the trust list, or no ``--trust`` was given;
43 (VERIFY_WATERMARK_ONLY) an image has no manifest but carries an sdserve watermark (its manifest was stripped;
the payload names the request in the server's log); 42 (VERIFY_NO_MANIFEST) an image has no manifest and no
watermark; 41 (VERIFY_INVALID) an image or its manifest changed after signing; 2 (USAGE) an image or the trust
list cannot be read, or an image declares more pixels than ``--max-pixels`` (the uploads' limits.max_image_pixels
by default), read from its header before a pixel is decoded (issue 57: a 93-byte PNG declaring 14000x14000 ended
in Pillow's uncaught DecompressionBombError, and a 79 KB 9000x9000 one took 33.9 s and 5.27 GB to read its
watermark).
"""

from __future__ import annotations

import argparse
import io
import json
import struct
import warnings
from pathlib import Path
from typing import Any

from PIL import Image

from engines.errors import InvalidRequestError
from server.exitcodes import ExitCode
from server.provenance_verify import Verification, verify_bytes
from server.settings import Limits

CODES = {"trusted": ExitCode.OK, "untrusted": ExitCode.VERIFY_UNTRUSTED, "no_manifest": ExitCode.VERIFY_NO_MANIFEST,
         "invalid": ExitCode.VERIFY_INVALID, "watermark_only": ExitCode.VERIFY_WATERMARK_ONLY}
RANK = ("trusted", "untrusted", "watermark_only", "no_manifest", "invalid")
"""Verdicts from best to worst: the exit code is the worst image's."""
MAX_PIXELS = int(Limits.model_fields["max_image_pixels"].default)
"""``--max-pixels``' default: the pixels an upload to the server may declare."""


def register(sub: Any) -> None:
    p = sub.add_parser("verify", help="print an image's C2PA manifest and whether it validates (exit 0 trusted, "
                                      "40 untrusted, 41 invalid, 42 no manifest, 43 watermark only)")
    p.add_argument("images", nargs="+", type=Path, metavar="IMAGE", help="PNG, JPEG or WebP files")
    p.add_argument("--trust", type=Path, default=None, metavar="CA.pem",
                   help="PEM trust anchors (the operator's CA); without it a valid signature is 'untrusted'")
    p.add_argument("--json", action="store_true", help="one JSON object per image instead of text")
    p.add_argument("--max-pixels", type=int, default=MAX_PIXELS, metavar="N",
                   help="refuse (exit 2) an image declaring more pixels (width x height, read from its header "
                        "before any pixel is decoded for the watermark)")
    p.set_defaults(run=run)


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise InvalidRequestError(f"cannot read {what} {path}: {exc.strerror or exc}", param=what) from None


def _png_size(data: bytes) -> tuple[int, int] | None:
    """A PNG's declared (width, height) from its IHDR, which Pillow refuses to report past its own bomb bound."""
    if data[:8] != b"\x89PNG\r\n\x1a\n" or data[12:16] != b"IHDR" or len(data) < 24:
        return None
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


def check_pixels(path: Path, data: bytes, max_pixels: int) -> None:
    """InvalidRequestError (exit 2) when the image at ``path`` declares more than ``max_pixels`` pixels; what
    Pillow cannot open at all is left to the verification, which reports it as no image."""
    size = _png_size(data)
    if size is None:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(io.BytesIO(data)) as image:
                    size = image.size
        except (Image.DecompressionBombError, Image.DecompressionBombWarning):
            size = None
        except (OSError, ValueError, SyntaxError, EOFError):
            return
        if size is None:
            raise InvalidRequestError(f"image {path} declares more pixels than Pillow decodes safely, over "
                                      f"--max-pixels {max_pixels}: it is not read", param="image")
    width, height = size
    if width * height > max_pixels:
        raise InvalidRequestError(f"image {path} declares {width}x{height} pixels, over --max-pixels {max_pixels}: "
                                  "it is not read (no pixel decoded); raise --max-pixels to verify it",
                                  param="image")


def render(path: Path, v: Verification) -> str:
    """The text report of one image."""
    lines = [f"{path}: {v.verdict.upper().replace('_', ' ')}"]
    lines += [f"  problem: {p}" for p in v.problems]
    if v.signer:
        lines.append(f"  signed by: {v.signer.get('common_name', '?')} (issuer {v.signer.get('issuer', '?')}, "
                     f"{v.signer.get('alg', '?')}{', at ' + str(v.signer['time']) if v.signer.get('time') else ''})")
    for agent in v.generator:
        lines.append(f"  generator: {agent.get('name', '?')} {agent.get('version', '')}".rstrip())
    for action in v.actions:
        lines.append(f"  action: {action.get('action')} ({action.get('digitalSourceType', 'no source type')})")
    for item in v.ingredients:
        lines.append(f"  ingredient: {item.get('title') or '?'} {item.get('relationship') or '?'} "
                     f"sha256 {item.get('sha256') or 'unknown'}")
    if v.watermark is not None:
        lines.append(f"  watermark: {_watermark_line(v.watermark)}")
    if v.generation is not None:
        lines.append("  org.sdserve.generation: " + json.dumps(v.generation, indent=2, sort_keys=True)
                     .replace("\n", "\n  "))
    return "\n".join(lines)


def _watermark_line(mark: dict[str, Any]) -> str:
    """One line on the pixels' watermark, and whether it is the one the manifest records."""
    claimed = mark.get("manifest_payload")
    if mark.get("skipped") == "too_small":
        found = "none (image under 256x256 pixels, too small to carry one)"
    elif mark.get("payload"):
        found = f"{mark['scheme']} {mark['payload']} (blocks agreeing {mark['agreement']:.0%})"
    else:
        found = f"none found (blocks agreeing {mark['agreement']:.0%}, an unmarked image gives 50-60%)"
    if claimed is None:
        return found
    if mark.get("matches_manifest"):
        return f"{found}, the payload the manifest records"
    bits = mark.get("bits_matching_manifest")
    return f"{found}; the manifest records {claimed}" + (f" ({bits}/64 bits match)" if bits is not None else "")


def _trust(path: Path) -> str:
    """The trust list's PEM text; a file holding no PEM certificate is a usage error, not an 'invalid' image."""
    from cryptography import x509

    data = _read(path, "--trust")
    try:
        x509.load_pem_x509_certificates(data)
    except ValueError:
        raise InvalidRequestError(f"--trust {path} holds no PEM certificates (the CA that issued the signer's "
                                  "chain)", param="--trust") from None
    return data.decode("ascii", "replace")


def run(args: argparse.Namespace) -> int:
    trust = _trust(args.trust) if args.trust else None
    worst = "trusted"
    for path in args.images:
        data = _read(path, "image")
        check_pixels(path, data, args.max_pixels)
        result = verify_bytes(data, trust)
        print(json.dumps({"image": str(path), **result.as_dict()}) if args.json else render(path, result))
        worst = max(worst, result.verdict, key=RANK.index)
    return int(CODES[worst])
