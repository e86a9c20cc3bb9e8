"""A bounded, short-lived store for images returned by URL (response_format "url")."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from fastapi import HTTPException


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
