"""A bounded, short-lived store for images returned by URL (response_format "url"), and the infotext written into
encoded images."""

from __future__ import annotations

import io
import secrets
import struct
import threading
import time
import zlib
from collections import OrderedDict

from fastapi import HTTPException
from PIL import Image


class ImageStore:
    """At most ``max_items`` images and ``max_bytes`` PNG bytes (the newest image is always kept), each for
    ``ttl_s`` seconds, oldest dropped first; ids are unguessable (128-bit). Each image is stored under its file
    name, ``<id>.<extension>`` (png unless the response asked for another output_format)."""

    def __init__(self, max_items: int = 256, ttl_s: float = 600.0, max_bytes: int = 64 << 20) -> None:
        self.max_items, self.ttl_s, self.max_bytes = max_items, ttl_s, max_bytes
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0

    def put(self, png: bytes, extension: str = "png") -> str:
        """Store one image; returns its file name."""
        image_id = f"{secrets.token_urlsafe(16)}.{extension}"
        with self._lock:
            self._evict()
            self._items[image_id] = (time.monotonic() + self.ttl_s, png)
            self.bytes += len(png)
            while len(self._items) > self.max_items or (self.bytes > self.max_bytes and len(self._items) > 1):
                self._drop_oldest()
        return image_id

    def get(self, image_id: str) -> bytes:
        """The image stored under this file name; 404 when unknown or expired."""
        with self._lock:
            self._evict()
            item = self._items.get(image_id)
        if item is None:
            raise HTTPException(404, "image not found or expired")
        return item[1]

    def _evict(self) -> None:
        now = time.monotonic()
        while self._items and next(iter(self._items.values()))[0] < now:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        _, (_, png) = self._items.popitem(last=False)
        self.bytes -= len(png)

    def __len__(self) -> int:
        return len(self._items)


# Infotexts: A1111's generation parameters written into the encoded images (modules/images.py save_image_with_geninfo:
# PNG a "parameters" text chunk, JPEG/WebP the EXIF UserComment). The provenance stage writes after this one.

PARAMETERS_KEY = "parameters"
USER_COMMENT = 0x9286
EXIF_IFD = 0x8769
_PNG = b"\x89PNG\r\n\x1a\n"
_IHDR_END = len(_PNG) + 25  # IHDR is always the first chunk: length, type, 13 bytes of data, CRC
_JPEG_SEGMENT_MAX = 65533


def embed_infotext(data: bytes, text: str) -> bytes:
    """``data`` (PNG, JPEG or WebP bytes) with ``text`` embedded where A1111 puts its infotext, without
    re-encoding: PNG a ``parameters`` tEXt chunk (iTXt, uncompressed UTF-8, when the text is not Latin-1, as PIL's
    PngInfo.add_text), JPEG an APP1 EXIF segment and WebP an EXIF chunk holding the UserComment (``UNICODE`` and
    UTF-16BE, as piexif.helper.UserComment.dump(encoding="unicode")). Other bytes, and a JPEG comment over the
    64 KiB a segment holds, come back unchanged."""
    if data.startswith(_PNG):
        return data[:_IHDR_END] + _png_text_chunk(PARAMETERS_KEY, text) + data[_IHDR_END:]
    if data.startswith(b"\xff\xd8"):
        payload = _exif(text)
        if len(payload) > _JPEG_SEGMENT_MAX:
            return data
        return data[:2] + b"\xff\xe1" + struct.pack(">H", len(payload) + 2) + payload + data[2:]
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return _webp_with_exif(data, _exif(text).removeprefix(b"Exif\x00\x00"))
    return data


def _png_text_chunk(key: str, text: str) -> bytes:
    try:
        kind, body = b"tEXt", key.encode("latin-1") + b"\x00" + text.encode("latin-1")
    except UnicodeEncodeError:
        kind, body = b"iTXt", key.encode("latin-1") + b"\x00\x00\x00\x00\x00" + text.encode("utf-8")
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def _exif(text: str) -> bytes:
    """EXIF (``Exif\\0\\0`` and TIFF) holding only the UserComment."""
    exif = Image.Exif()
    exif.get_ifd(EXIF_IFD)[USER_COMMENT] = b"UNICODE\x00" + text.encode("utf-16-be")
    return exif.tobytes()


def _webp_with_exif(data: bytes, tiff: bytes) -> bytes:
    """A simple (VP8/VP8L) WebP becomes extended (VP8X, EXIF flag) with an EXIF chunk after the image."""
    chunks = data[12:]
    if chunks[:4] == b"VP8X":
        flags = chunks[8] | 0x08
        chunks = chunks[:8] + bytes([flags]) + chunks[9:]
    else:
        width, height = Image.open(io.BytesIO(data)).size  # the header only
        body = bytes([0x08, 0, 0, 0]) + (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
        chunks = b"VP8X" + struct.pack("<I", len(body)) + body + chunks
    chunks += b"EXIF" + struct.pack("<I", len(tiff)) + tiff + (b"\x00" if len(tiff) % 2 else b"")
    return b"RIFF" + struct.pack("<I", len(chunks) + 4) + b"WEBP" + chunks
