"""A bounded, short-lived store for images returned by URL (response_format "url")."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from fastapi import HTTPException


class ImageStore:
    """At most ``max_items`` images, each for ``ttl_s`` seconds; ids are unguessable (128-bit)."""

    def __init__(self, max_items: int = 256, ttl_s: float = 600.0) -> None:
        self.max_items, self.ttl_s = max_items, ttl_s
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, png: bytes) -> str:
        image_id = secrets.token_urlsafe(16)
        with self._lock:
            self._evict()
            self._items[image_id] = (time.monotonic() + self.ttl_s, png)
            while len(self._items) > self.max_items:
                self._items.popitem(last=False)
        return image_id

    def get(self, image_id: str) -> bytes:
        with self._lock:
            self._evict()
            item = self._items.get(image_id)
        if item is None:
            raise HTTPException(404, "image not found or expired")
        return item[1]

    def _evict(self) -> None:
        now = time.monotonic()
        while self._items and next(iter(self._items.values()))[0] < now:
            self._items.popitem(last=False)

    def __len__(self) -> int:
        return len(self._items)
