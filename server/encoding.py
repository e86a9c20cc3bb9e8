"""Image encoding for OpenAI's ``output_format`` (png, jpeg, webp) and ``output_compression``."""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any

MEDIA_TYPES = {"png": "image/png", "jpeg": "image/jpeg", "webp": "image/webp"}
"""output_format -> media type; also the file extensions of response_format=url links."""
_PIL_FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP"}


@dataclass(frozen=True)
class ImageFormat:
    """How the images of one response are encoded: PNG (lossless, the default), or JPEG/WebP at ``quality``
    (OpenAI's output_compression, 0-100, default 100)."""

    name: str = "png"
    quality: int = 100

    @property
    def media_type(self) -> str:
        return MEDIA_TYPES[self.name]

    def encode(self, image: Any) -> bytes:
        """The PIL image as file bytes; the model's images are opaque RGB, so every format holds them whole."""
        buffer = io.BytesIO()
        if self.name == "png":
            image.save(buffer, format="PNG")
        else:
            image.convert("RGB").save(buffer, format=_PIL_FORMATS[self.name], quality=self.quality)
        return buffer.getvalue()


def media_type_of(filename: str) -> str | None:
    """The media type of a stored image's file name (``<id>.<ext>``); None for an unknown extension."""
    return MEDIA_TYPES.get(filename.rpartition(".")[2])
