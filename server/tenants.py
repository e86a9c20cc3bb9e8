"""Tenants at run time (issue 52 points 1 and 3): who a key belongs to, re-read from ``auth.tenants_file`` without a
restart, and each tenant's quotas: images queued and images per minute (a token bucket), the largest size and steps.
The per-tenant cap on requests in flight is the auth middleware's (server/middleware.py), which resolves the tenant.

A request is refused or admitted whole: its first admission is checked against the quotas, and what the same
request admits later (a Hires fix's second pass, A1111's later ``n_iter`` batches) is charged without a check, so no
request fails half-way because its own first part used the tokens. The request is the auth middleware's
``REQUEST`` context (one per HTTP request)."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import tomllib
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from engines.errors import ConfigError, InvalidRequestError
from engines.types.request import Batch
from server.errors import TenantLimitError
from server.metrics import tenant_series
from server.settings import AuthSettings
from server.tenant_config import (
    DEFAULT_SLO_P95_S,
    DEFAULT_TENANT,
    TenantConfig,
    TenantLimits,
    TenantsFile,
    check_tenants,
)

log = logging.getLogger(__name__)
Clock = Callable[[], float]
SloListener = Callable[[dict[str, float]], None]
NO_LIMITS = TenantLimits()


@dataclass
class RequestCharge:
    """One HTTP request: its tenant, and whether it was admitted (then the rest of it is charged unchecked)."""

    tenant: str = DEFAULT_TENANT
    admitted: bool = False


REQUEST: ContextVar[RequestCharge | None] = ContextVar("sdserve_tenant_request", default=None)
"""Set by the auth middleware for each request; None outside one (each admission is then checked on its own)."""


class TokenBucket:
    """``capacity`` tokens, refilled at ``rate`` per second on the injected clock's time."""

    def __init__(self, rate: float, capacity: float, now: float) -> None:
        self.rate, self.capacity = rate, capacity
        self.tokens, self.at = capacity, now

    def _refill(self, now: float) -> None:
        self.tokens = min(self.capacity, self.tokens + max(0.0, now - self.at) * self.rate)
        self.at = max(self.at, now)

    def wait_s(self, n: float, now: float) -> float:
        """Seconds until ``n`` tokens are there (0: now)."""
        self._refill(now)
        return max(0.0, (n - self.tokens) / self.rate)

    def take(self, n: float, now: float, force: bool = False) -> float:
        """Take ``n`` tokens and return 0, or take none and return the seconds until there are enough. ``force``
        takes them anyway (the bucket may go below zero: the debt delays the next request)."""
        wait = self.wait_s(n, now)
        if wait > 0 and not force:
            return wait
        self.tokens -= n
        return 0.0


@dataclass(frozen=True)
class TenantSet:
    """One consistent view of the tenants: the profile's plus the file's."""

    tenants: tuple[TenantConfig, ...]
    digests: tuple[str, ...]
    """Every accepted key's digest: ``auth.api_key_sha256`` (keys that may be in no tenant) and the tenants'."""
    by_label: dict[str, TenantConfig] = field(default_factory=dict)
    by_digest: dict[str, str] = field(default_factory=dict)

    @classmethod
    def of(cls, tenants: Sequence[TenantConfig], keys: Sequence[str]) -> TenantSet:
        """ValueError for a label twice or a digest in two tenants."""
        check_tenants(tenants)
        by_digest = {d: t.label for t in tenants for d in t.digests}
        return cls(tuple(tenants), tuple(dict.fromkeys([*keys, *by_digest])), {t.label: t for t in tenants},
                   by_digest)


def read_tenants_file(path: Path) -> tuple[TenantConfig, ...]:
    """The tenants of a file (``.json``: JSON, else TOML) or of a folder's ``*.toml``/``*.json`` files (a mounted
    Secret; its hidden ``..data`` entries skipped). ConfigError names the file and the problem."""
    files = _tenant_files(path)
    found: list[TenantConfig] = []
    for file in files:
        try:
            text = file.read_text(encoding="utf-8")
            data = json.loads(text) if file.suffix == ".json" else tomllib.loads(text)
            found += TenantsFile.model_validate(data).tenants
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"tenants file {file}: cannot read it: {exc}") from None
        except (ValueError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"tenants file {file}: {_problem(exc)}") from None
    return tuple(found)


def _tenant_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.iterdir() if not p.name.startswith(".") and p.suffix in (".toml", ".json")
                      and p.is_file())
    if not path.exists():
        raise ConfigError(f"tenants file {path} not found (auth.tenants_file)")
    return [path]


def _problem(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
    return str(exc)


def _signature(path: Path) -> tuple[tuple[str, int, int, int], ...]:
    """What says a tenants file changed: each file's name, modification time, size and inode (a Secret's update
    swaps a symlink, which stat follows)."""
    try:
        files = [path] if not path.is_dir() else sorted(p for p in path.iterdir() if not p.name.startswith("."))
        stats = [(p.name, os.stat(p)) for p in files]
    except OSError:
        return ()
    return tuple((name, s.st_mtime_ns, s.st_size, s.st_ino) for name, s in stats)


class TenantRegistry:
    """The tenants now in force: the profile's ``[[auth.tenants]]`` and the tenants file's, re-read when the file
    changes (checked at most every ``auth.tenants_reload_s`` seconds, on the next request). A reload that fails
    keeps the tenants in force and says so (the log, ``snapshot()``)."""

    def __init__(self, auth: AuthSettings, clock: Clock = time.monotonic) -> None:
        """Reads the tenants file; ConfigError (exit 10) when it is unreadable or invalid at boot."""
        self.auth, self.clock = auth, clock
        self.path = Path(auth.tenants_file) if auth.tenants_file else None
        self.reload_error: str | None = None
        self.reloads = 0
        self._slo_listeners: list[SloListener] = []
        self._checked = clock()
        self._seen = _signature(self.path) if self.path is not None else ()
        try:
            self.current = self._load()
        except ValueError as exc:
            raise ConfigError(f"auth.tenants_file: {exc}") from None
        self.weights = Weights(self)
        """Label -> weight, live across reloads (the step scheduler's fair share: server/stepper.py)."""

    @property
    def enabled(self) -> bool:
        return self.auth.enabled

    def _load(self) -> TenantSet:
        from_file = read_tenants_file(self.path) if self.path is not None else ()
        return TenantSet.of([*self.auth.tenants, *from_file], self.auth.api_key_sha256)

    def refresh(self) -> None:
        """Re-read the tenants file if its check interval passed and it changed since the last read."""
        now = self.clock()
        if self.path is None or now - self._checked < self.auth.tenants_reload_s:
            return
        self._checked = now
        seen = _signature(self.path)
        if seen == self._seen:
            return
        self._seen = seen
        try:
            self.current = self._load()
        except (ConfigError, ValueError) as exc:
            self.reload_error = str(exc)
            log.error("tenants file reload failed, the previous %d tenant(s) stay in force: %s",
                      len(self.current.tenants), exc)
            return
        self.reload_error, self.reloads = None, self.reloads + 1
        log.info("tenants file reloaded: %d tenant(s)", len(self.current.tenants))
        for listener in self._slo_listeners:
            listener(self.slos())

    def slos(self) -> dict[str, float]:
        """Tenant series label -> the p95 threshold (seconds) in force, for each configured tenant whose label is a
        series label (server/metrics.py tenant_series: every configured label with auth on, only ``default``
        without)."""
        configured = self.current.by_label
        return {label: tenant.slo.threshold_p95_s for label, tenant in configured.items()
                if tenant_series(label, configured, self.enabled) == label}

    def watch_slos(self, listener: SloListener) -> None:
        """Call ``listener`` with ``slos()`` now and after every successful reload (a failed one keeps the old)."""
        self._slo_listeners.append(listener)
        listener(self.slos())

    def label_for(self, digest: str) -> str:
        """The tenant of an accepted key's digest: its configured label, else its key id (digest[:8])."""
        return self.current.by_digest.get(digest) or digest[:8]

    def limits(self, label: str) -> TenantLimits:
        tenant = self.current.by_label.get(label)
        return tenant.limits if tenant is not None else NO_LIMITS

    def in_flight_cap(self, label: str) -> int | None:
        """Requests the tenant may have in flight: its limit, else ``auth.per_key_concurrency`` with auth on (no cap
        without auth unless the ``default`` tenant sets one)."""
        own = self.limits(label).in_flight
        return own if own is not None else self.auth.per_key_concurrency if self.enabled else None

    def snapshot(self) -> dict[str, Any]:
        """For /capabilities: labels, weights, limits and SLOs (``default``: the tenant sets none, the server-wide
        p95 applies), never a digest or a path."""
        return {"auth": self.enabled, "default_tenant": DEFAULT_TENANT,
                "unconfigured_keys": {"label": "key id (digest[:8])", "weight": 1.0,
                                      "in_flight": self.auth.per_key_concurrency,
                                      "slo": {"p95_s": DEFAULT_SLO_P95_S, "default": True}},
                "tenants": [{"label": t.label, "weight": t.weight,
                             "limits": t.limits.model_dump(exclude_none=True),
                             "slo": {"p95_s": t.slo.threshold_p95_s, "default": t.slo.p95_s is None}}
                            for t in self.current.tenants],
                "file": None if self.path is None else {"reload_s": self.auth.tenants_reload_s,
                                                        "reloads": self.reloads, "error": self.reload_error}}


class Weights(Mapping[str, float]):
    """Label -> weight of the configured tenants as they are now; an unknown label weighs 1.0 (``get``)."""

    def __init__(self, registry: TenantRegistry) -> None:
        self._registry = registry

    def __getitem__(self, label: str) -> float:
        return self._registry.current.by_label[label].weight

    def __iter__(self) -> Iterator[str]:
        return iter(self._registry.current.by_label)

    def __len__(self) -> int:
        return len(self._registry.current.by_label)


class TenantQuotas:
    """Each tenant's images queued and its token bucket, checked when a request is admitted (``admit``), and its
    largest size and steps (``check_shape``)."""

    def __init__(self, registry: TenantRegistry, clock: Clock = time.monotonic) -> None:
        self.registry, self.clock = registry, clock
        self.queued: Counter[str] = Counter()
        """Images of each tenant's admitted requests not finished yet."""
        self._buckets: dict[str, TokenBucket] = {}

    def check_shape(self, label: str, batches: Sequence[Batch], size_param: str = "size") -> None:
        """400 (A1111: 422) naming the field (``size_param`` for the size) when a batch is larger or longer than
        the tenant may ask."""
        limits = self.registry.limits(label)
        for b in batches:
            over = _shape_over(limits, b)
            if over is not None:
                param, what = over
                raise InvalidRequestError(f"tenant {label!r} may ask at most {what} (its auth.tenants limits)",
                                          param=size_param if param == "size" else param)

    @contextmanager
    def admit(self, label: str, images: int) -> Iterator[None]:
        """Count ``images`` as queued for ``label`` while the block runs. Refused (TenantLimitError, 429 with
        Retry-After) when the tenant's queued images or its bucket cannot take them, unless an earlier part of
        the same request was admitted; a request larger than a limit can ever allow is a 400."""
        limits, request = self.registry.limits(label), REQUEST.get()
        if request is None or not request.admitted:
            self._check(label, limits, images)
        else:
            self.charge(label, images)
        if request is not None:
            request.admitted = True
        self.queued[label] += images
        try:
            yield
        finally:
            self.queued[label] -= images
            if self.queued[label] <= 0:
                del self.queued[label]

    def _check(self, label: str, limits: TenantLimits, images: int) -> None:
        cap = limits.images_queued
        if cap is not None:
            if images > cap:
                raise InvalidRequestError(f"{images} images at once: tenant {label!r} may have at most {cap} "
                                          "images queued (its images_queued limit)", param="n")
            if self.queued[label] + images > cap:
                raise TenantLimitError(f"tenant {label!r} is over its images_queued limit: {self.queued[label]} of "
                                       f"{cap} images queued, this request asks {images}", 1, "images_queued")
        bucket = self._bucket(label, limits)
        if bucket is None:
            return
        if images > bucket.capacity:
            raise InvalidRequestError(f"{images} images at once: tenant {label!r} may start at most "
                                      f"{bucket.capacity:g} at a time (its images_per_minute burst)", param="n")
        wait = bucket.take(images, self.clock())
        if wait > 0:
            raise TenantLimitError(f"tenant {label!r} is over its images_per_minute limit "
                                   f"({limits.images_per_minute:g} per minute, burst {bucket.capacity:g}): "
                                   f"{images} image(s) can start in {wait:.1f}s", math.ceil(wait),
                                   "images_per_minute")

    def _bucket(self, label: str, limits: TenantLimits) -> TokenBucket | None:
        """The tenant's bucket; a reload that changed its rate or size starts it again (full, or as full as it
        was)."""
        capacity = limits.capacity
        if limits.images_per_minute is None or capacity is None:
            self._buckets.pop(label, None)
            return None
        rate = limits.images_per_minute / 60.0
        bucket = self._buckets.get(label)
        if bucket is None or (bucket.rate, bucket.capacity) != (rate, capacity):
            now = self.clock()
            fresh = TokenBucket(rate, capacity, now)
            if bucket is not None:
                bucket.wait_s(0, now)
                fresh.tokens = min(capacity, bucket.tokens)
            self._buckets[label] = bucket = fresh
        return bucket

    def charge(self, label: str, images: int) -> None:
        """Take ``images`` from the tenant's bucket unchecked (work the request had admitted)."""
        bucket = self._bucket(label, self.registry.limits(label))
        if bucket is not None:
            bucket.take(images, self.clock(), force=True)


def _shape_over(limits: TenantLimits, batch: Batch) -> tuple[str, str] | None:
    """(the field, what the tenant may ask) for the first limit ``batch`` is over, else None."""
    if limits.max_steps is not None and batch.steps > limits.max_steps:
        return "steps", f"{limits.max_steps} steps, got {batch.steps}"
    size = f"{batch.width}x{batch.height}"
    if limits.max_width is not None and batch.width > limits.max_width:
        return "size", f"width {limits.max_width}, got {size}"
    if limits.max_height is not None and batch.height > limits.max_height:
        return "size", f"height {limits.max_height}, got {size}"
    if limits.max_pixels is not None and batch.width * batch.height > limits.max_pixels:
        return "size", f"{limits.max_pixels} pixels (width x height), got {size}"
    return None
