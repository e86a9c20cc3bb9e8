"""Reading an infotext back (POST /sdapi/v1/png-info) from client bytes, as A1111's modules/images.py
read_info_from_image and modules/infotext_utils.py parse_generation_parameters do: in linear time, bounded, off the
event loop.

A1111 finds the ``key: value`` pairs with one regular expression (``re_param``; tests/unit/test_hostile_metadata.py
keeps it to check ``pairs`` against): on a line without ``:`` it backtracks through every start position and every
key length, quadratic in the line (60,000 characters took 40 s, 1,000,000 about 2.5 h, on the event loop: issue
43). ``pairs`` finds the same pairs in one pass. A key can only end at a colon, and only where the run of key
characters (word characters, space, ``-``, ``/``) before that colon holds a word character at least two characters
before it (the key starts at the first one); so a key is searched from the start of such a run only (a
lookbehind), with possessive quantifiers that never give back, and a value ends at the first comma or at its
closing quote.

Bounds (a reply is at most ``MAX_REPLY_BYTES``; anything more is a 422 naming ``image``, never a truncated
answer a client would take for the whole): the PNG's chunks and text as server/png_text.py checks them for every
upload, at most ``MAX_TEXT_CHARS`` characters of text in the infotext and the other items together (EXIF, XMP and
comments of JPEG/WebP/GIF included), and the JSON reply itself."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from PIL import Image

from engines.errors import InvalidRequestError
from server import png_text
from server.images_in import from_base64_bytes, open_header

KEY = re.compile(r"(?<![\w \-/])[ \-/]*+(\w[\w \-/]++):")
"""A key: the first word character of a run of key characters, up to the colon that ends the run."""
SPACE = re.compile(r"\s*+")
QUOTED = re.compile(r'"(?:\\.|[^\\"])++"')
"""A JSON-quoted value (quote() writes one when the value holds a comma, colon or newline)."""
IMAGE_SIZE = re.compile(r"^(\d+)x(\d+)$")
DEFAULTS: dict[str, Any] = {"Clip skip": "1", "Hires resize-1": 0, "Hires resize-2": 0,
                            "Hires sampler": "Use same sampler", "Hires checkpoint": "Use same checkpoint",
                            "Hires prompt": "", "Hires negative prompt": "", "Mask mode": "Inpaint masked",
                            "Masked content": "original", "Inpaint area": "Whole picture", "Masked area padding": 32,
                            "RNG": "GPU", "Schedule type": "Automatic", "Schedule max sigma": 0,
                            "Schedule min sigma": 0, "Schedule rho": 0, "VAE Encoder": "Full", "VAE Decoder": "Full",
                            "FP8 weight": "Disable"}
"""What parse_generation_parameters fills in for a parameter the text does not name."""
IGNORED_INFO_KEYS = frozenset({"jfif", "jfif_version", "jfif_unit", "jfif_density", "dpi", "exif", "loop",
                               "background", "timestamp", "duration", "progressive", "progression", "icc_profile",
                               "chromaticity", "photoshop"})
"""Image info keys read_info_from_image drops from ``items``."""
_COMMENT_CODECS = {b"ASCII\x00\x00\x00": "ascii", b"JIS\x00\x00\x00\x00\x00": "shift_jis",
                   b"UNICODE\x00": "utf-16-be"}
"""EXIF UserComment character codes (piexif.helper.UserComment.load)."""
MAX_TEXT_CHARS = 2 << 20
"""Characters of text (the infotext and every other item) png-info reads from one image."""
MAX_REPLY_BYTES = 8 << 20
"""Bytes of one png-info reply (JSON escapes can make text up to six times longer)."""
MAX_PARSED_CHARS = 64 << 10
"""Longest infotext whose parsed ``parameters`` repeat it in the reply. A1111 answers the text twice (``info``, and
its prompt, negative prompt and values again in ``parameters``); an infotext a generator writes is a few KB, so
the reply repeats only what fits this bound: a longer text is answered once, in ``info``, with ``parameters`` {}
(issue 57: a 1,061-byte zTXt chunk made an 8.28 MB reply, 7,804x, half of it the text's second copy)."""


def pairs(line: str) -> list[tuple[str, str]]:
    """The (key, value) pairs A1111's PARAM regex finds in ``line`` (one line: no newline), in linear time."""
    found: list[tuple[str, str]] = []
    pos = 0
    while (key := KEY.search(line, pos)) is not None:
        start = key.end()
        start = SPACE.match(line, start).end()  # type: ignore[union-attr]  # \s*+ always matches
        quoted = QUOTED.match(line, start) if line.startswith('"', start) else None
        if quoted is not None and (quoted.end() == len(line) or line[quoted.end()] == ","):
            end = quoted.end()
        else:  # unquoted, or a quote not closed before a comma or the end: up to the next comma
            end = line.find(",", start)
            end = len(line) if end < 0 else end
        found.append((key.group(1), line[start:end]))
        pos = end + 1
    return found


def _unquote(text: str) -> str:
    if len(text) < 2 or text[0] != '"' or text[-1] != '"':
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, str) else text


def parse_infotext(text: str) -> dict[str, Any]:
    """The parameters dict of an infotext: Prompt, Negative prompt, every ``key: value`` of the last line (a
    WIDTHxHEIGHT value split into ``key-1``/``key-2``), and A1111's defaults for the ones it does not name."""
    *lines, last = text.strip().split("\n")
    found_pairs = pairs(last)
    if len(found_pairs) < 3:
        lines.append(last)
        found_pairs = []
    prompt: list[str] = []
    negative: list[str] = []
    for line in (line.strip() for line in lines):
        if line.startswith("Negative prompt:"):
            negative.append(line[len("Negative prompt:"):].strip())
        else:
            (negative if negative else prompt).append(line)
    found: dict[str, Any] = {"Prompt": "\n".join(prompt), "Negative prompt": "\n".join(negative)}
    for key, value in found_pairs:
        value = _unquote(value)
        size = IMAGE_SIZE.match(value)
        if size is not None:
            found[f"{key}-1"], found[f"{key}-2"] = size.group(1), size.group(2)
        else:
            found[key] = value
    return found | {k: v for k, v in DEFAULTS.items() if k not in found}


def _json_safe(value: object) -> Any:
    if isinstance(value, str | int | bool):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    return value.decode("utf8", errors="replace") if isinstance(value, bytes) else str(value)


def read_infotext(image: Image.Image) -> tuple[str, dict[str, Any]]:
    """(the infotext, the image's other info items) of a decoded image: the PNG ``parameters`` text, else the
    EXIF UserComment (JPEG, WebP), else a GIF comment; "" when there is none. Items are JSON-safe (bytes
    decoded as UTF-8, other values as text)."""
    items = dict(image.info or {})
    text = items.pop("parameters", None)
    if "exif" in items:
        items.pop("exif")
        comment = image.getexif().get_ifd(0x8769).get(0x9286)
        if isinstance(comment, bytes) and comment:
            codec = _COMMENT_CODECS.get(comment[:8])
            text = comment[8:].decode(codec, errors="ignore") if codec else comment.decode("utf8", errors="ignore")
    elif "comment" in items:
        comment = items["comment"]
        text = comment.decode("utf8", errors="ignore") if isinstance(comment, bytes) else str(comment)
    safe = {str(k): _json_safe(v) for k, v in items.items() if k not in IGNORED_INFO_KEYS}
    return (text if isinstance(text, str) else ""), safe


def _text_chars(text: str, items: dict[str, Any]) -> int:
    return len(text) + sum(len(k) + (len(v) if isinstance(v, str) else 0) for k, v in items.items())


def png_info_body(image_text: str, max_pixels: int) -> bytes:
    """The JSON reply of POST /sdapi/v1/png-info for A1111's base64 ``image`` (run in a worker thread): its
    infotext, other text items and parsed parameters (for a text of at most ``MAX_PARSED_CHARS``: the text comes
    back once), within this module's bounds (else a 422 naming ``image``)."""
    data = from_base64_bytes(image_text.strip(), "image")
    # server/png_text.py's bounds first, then the upload limits; no pixel is decoded: the text is all png-info
    # needs (a PNG's text chunks after its image data are read from the chunks, where Pillow would decode first)
    image = open_header(data, "image", max_pixels)
    if image.format == "PNG":
        image.info.update(png_text.texts(data))
    text, items = read_infotext(image)
    chars = _text_chars(text, items)
    if chars > MAX_TEXT_CHARS:
        raise InvalidRequestError(f"image holds {chars} characters of text (infotext, EXIF, XMP, comments), over "
                                  f"the {MAX_TEXT_CHARS} png-info reads", param="image")
    parsed = parse_infotext(text) if text and len(text) <= MAX_PARSED_CHARS else {}
    reply = {"info": text, "items": items, "parameters": parsed}
    body = json.dumps(reply, ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    if len(body) > MAX_REPLY_BYTES:
        raise InvalidRequestError(f"image: its text makes a png-info reply of {len(body)} bytes, over the "
                                  f"{MAX_REPLY_BYTES} this server answers", param="image")
    return body
