"""The text chunks of an uploaded PNG (tEXt, zTXt, iTXt), checked against fixed bounds before Pillow reads them.

Pillow inflates each zTXt/iTXt chunk up to 1 MiB and keeps up to 64 MiB of text per image (PngImagePlugin's
MAX_TEXT_CHUNK / MAX_TEXT_MEMORY): a 64 KB PNG of compressed zeros became 64 MiB of text and, through png-info, a
384 MB reply (issue 43). Every upload (png-info, img2img, edits) passes ``check`` first: at most ``MAX_CHUNKS``
chunks, ``MAX_TEXT_CHUNKS`` text chunks, ``MAX_CHUNK_TEXT`` bytes inflated per chunk and ``MAX_TEXT_BYTES`` of
text in all. Inflating is bounded by ``zlib.decompressobj`` with ``max_length``, so a compressed bomb never costs
more than the bound in memory; anything over a bound is a 4xx naming the field, never a truncated read that
Pillow would then redo without our bounds."""

from __future__ import annotations

import zlib
from collections.abc import Iterator

from engines.errors import InvalidRequestError

SIGNATURE = b"\x89PNG\r\n\x1a\n"
TEXT_KINDS = (b"tEXt", b"zTXt", b"iTXt")
MAX_CHUNKS = 100_000
"""Chunks of any kind in one PNG (a 16 MiB upload in libpng's 8 KiB IDAT chunks is about 2,000)."""
MAX_TEXT_CHUNKS = 64
"""Text chunks in one PNG (A1111 writes one, ``parameters``; ComfyUI two, ``prompt`` and ``workflow``)."""
MAX_CHUNK_TEXT = 1 << 20
"""Bytes one text chunk may hold once inflated: Pillow's own MAX_TEXT_CHUNK, said here by name first."""
MAX_TEXT_BYTES = 2 << 20
"""Bytes of text all chunks of one PNG may hold once inflated."""


def chunks(data: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(type, payload) of each chunk up to IEND or the end of the bytes (a chunk cut short yields what is there)."""
    pos = len(SIGNATURE)
    while pos + 8 <= len(data):
        length = int.from_bytes(data[pos:pos + 4], "big")
        kind = data[pos + 4:pos + 8]
        yield kind, data[pos + 8:pos + 8 + length]
        if kind == b"IEND":
            return
        pos += 12 + length


def inflated_size(payload: bytes, limit: int) -> int:
    """Bytes ``payload`` (a zlib stream) inflates to, counted up to ``limit + 1`` (then it stops: over the limit);
    a corrupt stream counts what inflated before the error (Pillow then reads it as empty text)."""
    inflate, total = zlib.decompressobj(), 0
    try:
        total += len(inflate.decompress(payload, limit + 1))
        while inflate.unconsumed_tail and total <= limit:
            total += len(inflate.decompress(inflate.unconsumed_tail, limit + 1 - total))
    except zlib.error:
        pass
    return total


def text_size(kind: bytes, payload: bytes, limit: int) -> int:
    """Bytes of text one chunk holds (inflated when compressed), counted up to ``limit + 1``."""
    _, _, rest = payload.partition(b"\x00")
    if kind == b"zTXt":
        return inflated_size(rest[1:], limit)
    if kind == b"iTXt" and len(rest) >= 2:
        compressed, body = rest[0], rest[2:].split(b"\x00", 2)
        text = body[2] if len(body) == 3 else b""
        return inflated_size(text, limit) if compressed else len(text)
    return len(rest)


def texts(data: bytes) -> dict[str, str]:
    """Each text chunk's keyword -> text, read from the chunks without decoding a pixel (Pillow reads text chunks
    after the image data only when it decodes the pixels): tEXt and zTXt in Latin-1, iTXt in UTF-8, compressed
    ones inflated within ``MAX_CHUNK_TEXT``. Call ``check`` first (it bounds the count and the text in all); a
    chunk that does not parse is skipped, as Pillow skips it. The last chunk of a keyword wins, as in Pillow."""
    found: dict[str, str] = {}
    if not data.startswith(SIGNATURE):
        return found
    for kind, payload in chunks(data):
        if kind not in TEXT_KINDS:
            continue
        key, _, rest = payload.partition(b"\x00")
        try:
            if kind == b"tEXt":
                text = rest.decode("latin-1")
            elif kind == b"zTXt":
                text = _inflate(rest[1:]).decode("latin-1")
            else:
                compressed, body = rest[:1] == b"\x01", rest[2:].split(b"\x00", 2)
                raw = body[2] if len(body) == 3 else b""
                text = (_inflate(raw) if compressed else raw).decode("utf-8")
        except (zlib.error, UnicodeDecodeError):
            continue
        found[key.decode("latin-1")] = text
    return found


def _inflate(payload: bytes) -> bytes:
    inflate = zlib.decompressobj()
    return inflate.decompress(payload, MAX_CHUNK_TEXT)


def check(data: bytes, field: str) -> None:
    """Refuse (InvalidRequestError naming ``field``) a PNG whose chunks or text go past this module's bounds;
    anything that is not a PNG passes untouched."""
    if not data.startswith(SIGNATURE):
        return
    count = texts = total = 0
    for kind, payload in chunks(data):
        count += 1
        if count > MAX_CHUNKS:
            raise InvalidRequestError(f"{field} is a PNG of more than {MAX_CHUNKS} chunks", param=field)
        if kind not in TEXT_KINDS:
            continue
        texts += 1
        if texts > MAX_TEXT_CHUNKS:
            raise InvalidRequestError(f"{field} is a PNG of more than {MAX_TEXT_CHUNKS} text chunks (tEXt, zTXt, "
                                      "iTXt)", param=field)
        size = text_size(kind, payload, min(MAX_CHUNK_TEXT, MAX_TEXT_BYTES - total))
        key = payload.partition(b"\x00")[0][:79].decode("latin-1")
        if size > MAX_CHUNK_TEXT:
            raise InvalidRequestError(f"{field}: its PNG {kind.decode()} chunk {key!r} holds more than "
                                      f"{MAX_CHUNK_TEXT} bytes of text once inflated", param=field)
        total += size
        if total > MAX_TEXT_BYTES:
            raise InvalidRequestError(f"{field}: its PNG text chunks hold more than {MAX_TEXT_BYTES} bytes of "
                                      f"text in all once inflated (at chunk {key!r})", param=field)
