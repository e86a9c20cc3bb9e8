"""What the invisible watermark survives (server/watermark.py): bit accuracy and exact-payload recovery after JPEG,
resize and crop, on 256x256 and 512x512 textured images (1/f "pink" noise in correlated colours: the spectrum of
natural photographs), ours beside ``imwatermark``'s own dwtDct embedder (the test extra; it imports torch).

    python benchmarks/bench_watermark.py [--images 8] [--out benchmarks/results/watermark.json]
                                         [--write-readme docs/provenance.md]
"""

from __future__ import annotations

import argparse
import io
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray
from PIL import Image

sys.path.insert(0, str(Path(__file__).parents[1]))
from readme import write_section  # noqa: E402

from server import watermark as wm  # noqa: E402

Rgb = NDArray[np.uint8]
SIZES = (256, 512)


def textured(size: int, seed: int) -> Rgb:
    """A size x size RGB image of 1/f noise, colours correlated as in photographs; same seed, same image."""
    rng = np.random.default_rng(seed)
    f = np.fft.fftfreq(size)
    radius = np.hypot(f[:, None], f[None, :])
    radius[0, 0] = 1.0
    planes = [np.real(np.fft.ifft2(np.fft.fft2(rng.normal(size=(size, size))) / radius)) for _ in range(3)]
    planes = [(p - p.mean()) / p.std() for p in planes]
    mix = np.array([[1.0, 0.6, 0.3], [0.6, 1.0, 0.5], [0.3, 0.5, 1.0]])
    image: Rgb = np.clip(128 + 40 * np.einsum("ij,jhw->hwi", mix, np.array(planes)), 0, 255).astype(np.uint8)
    return image


def _jpeg(quality: int) -> Callable[[Rgb], Rgb]:
    def attack(rgb: Rgb) -> Rgb:
        buffer = io.BytesIO()
        Image.fromarray(rgb).save(buffer, format="JPEG", quality=quality)  # PIL's default: 4:2:0 chroma
        return np.asarray(Image.open(buffer).convert("RGB"))
    return attack


def _resize(scale: float) -> Callable[[Rgb], Rgb]:
    def attack(rgb: Rgb) -> Rgb:
        h, w = rgb.shape[:2]
        return np.asarray(Image.fromarray(rgb).resize((round(w * scale), round(h * scale)), Image.Resampling.LANCZOS))
    return attack


def _crop(share: float, edge: str) -> Callable[[Rgb], Rgb]:
    def attack(rgb: Rgb) -> Rgb:
        h, w = rgb.shape[:2]
        return rgb[:h - round(h * share)] if edge == "bottom" else rgb[:, :w - round(w * share)]
    return attack


ATTACKS: dict[str, Callable[[Rgb], Rgb]] = {
    "none (PNG)": lambda rgb: rgb,
    **{f"JPEG quality {q}": _jpeg(q) for q in (95, 90, 75, 50)},
    **{f"resize {s:g}x": _resize(s) for s in (0.5, 0.75, 1.5)},
    **{f"crop {p:.0%} off the {e}": _crop(p, e) for p in (0.10, 0.25) for e in ("bottom", "right")},
}


def _library() -> tuple[Callable[[Rgb, bytes], Rgb], Callable[[Rgb], bytes]] | None:
    try:
        from imwatermark import WatermarkDecoder, WatermarkEncoder
    except ImportError:
        return None

    def embed(rgb: Rgb, payload: bytes) -> Rgb:
        encoder = WatermarkEncoder()
        encoder.set_watermark("bytes", payload)
        return np.ascontiguousarray(encoder.encode(np.ascontiguousarray(rgb[..., ::-1]), "dwtDct")[..., ::-1])

    def decode(rgb: Rgb) -> bytes:
        if wm.too_small(rgb.shape[1], rgb.shape[0]):  # the library raises on these
            return b""
        return bytes(WatermarkDecoder("bytes", wm.PAYLOAD_BITS).decode(np.ascontiguousarray(rgb[..., ::-1]), "dwtDct"))

    return embed, decode


def _ours_decode(rgb: Rgb) -> bytes:
    return np.packbits(wm.decode(rgb)[0]).tobytes() if not wm.too_small(rgb.shape[1], rgb.shape[0]) else b""


def _score(got: bytes, want: bytes) -> tuple[float, bool]:
    if len(got) != len(want):
        return 0.5, False
    return float(np.mean(wm.to_bits(got) == wm.to_bits(want))), got == want


def measure(images: int) -> dict[str, dict[str, dict[str, Any]]]:
    """{embedder: {size: {attack: bit accuracy, exact share, ...}}} over ``images`` images per size."""
    library = _library()
    embedders: dict[str, tuple[Callable[[Rgb, bytes], Rgb], Callable[[Rgb], bytes]]] = {
        "sdserve": (lambda rgb, p: wm.embed(rgb, wm.to_bits(p)), _ours_decode)}
    if library is not None:
        embedders["imwatermark"] = library
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, (embed, decode) in embedders.items():
        for size in SIZES:
            rows: dict[str, list[tuple[float, bool]]] = {attack: [] for attack in ATTACKS}
            psnr = []
            for seed in range(images):
                original = textured(size, seed)
                payload = wm.payload_for(f"bench-{size}-{seed}", 0)
                marked = embed(original, payload)
                psnr.append(10 * np.log10(255 ** 2 / np.mean((marked.astype(float) - original) ** 2)))
                for attack, run in ATTACKS.items():
                    rows[attack].append(_score(decode(run(marked)), payload))
            table = {attack: {"bit_accuracy": float(np.mean([b for b, _ in r])),
                              "exact": float(np.mean([e for _, e in r]))} for attack, r in rows.items()}
            out.setdefault(name, {})[str(size)] = {**table, "psnr_db": float(np.mean(psnr))}
    return out


def markdown(results: dict[str, dict[str, dict[str, Any]]], images: int) -> str:
    ours = results["sdserve"]
    lib = results.get("imwatermark")
    head = ["attack"] + [f"{s}² bits / exact" for s in SIZES] + ([f"imwatermark {s}² bits / exact" for s in SIZES]
                                                                if lib else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

    def cell(entry: object) -> str:
        assert isinstance(entry, dict)
        return f"{entry['bit_accuracy']:.1%} / {entry['exact']:.0%}"

    for attack in ATTACKS:
        row = [attack] + [cell(ours[str(s)][attack]) for s in SIZES]
        row += [cell(lib[str(s)][attack]) for s in SIZES] if lib else []
        lines.append("| " + " | ".join(row) + " |")
    psnr = [f"{ours[str(s)]['psnr_db']:.1f} dB" for s in SIZES] + \
        ([f"{lib[str(s)]['psnr_db']:.1f} dB" for s in SIZES] if lib else [])
    lines.append("| PSNR of the marked image | " + " | ".join(psnr) + " |")
    return (f"Measured by `benchmarks/bench_watermark.py` over {images} images per size (64-bit payloads; "
            "\"bits\": share of payload bits right, \"exact\": share of images whose whole payload reads back).\n\n"
            + "\n".join(lines))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    parser.add_argument("--images", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--write-readme", type=Path, default=None)
    args = parser.parse_args()
    results = measure(args.images)
    text = markdown(results, args.images)
    print(text)
    if args.out:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
    if args.write_readme and not write_section(args.write_readme, "watermark", text):
        print(f"no bench:watermark markers in {args.write_readme}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
