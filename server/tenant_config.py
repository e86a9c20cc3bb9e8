"""Tenants as configured (issue 52 point 1): who a tenant is (a label and the sha256 digests of its keys), its share
of the machine (weight) and its limits. Plain pydantic models, validated the same way from a profile's
``[[auth.tenants]]`` (server/settings.py) and from the reloadable tenants file (server/tenants.py).

A request's tenant is a label string: the configured tenant's label for its key, an unconfigured but accepted key's
id (its digest's first 8 hex characters), or ``default`` when auth is off."""

from __future__ import annotations

import re
from collections.abc import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

DEFAULT_TENANT = "default"
"""The one tenant of a server without auth (its limits: a configured tenant of this label, if any)."""
_LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,62}")
_KEY_ID = re.compile(r"[0-9a-f]{8}")
_DIGEST = re.compile(r"[0-9a-f]{64}")
DEFAULT_SLO_P95_S = 30.0
"""The generation p95 (seconds, end to end) a tenant is judged against when its ``slo.p95_s`` is unset: the
per-tenant alert's fallback (deploy/prometheus/tenant_alerts.yml) and the rollout analysis's (server/cli/rollout.py)
use this same number for series without a ``sdserve_tenant_slo_p95_seconds`` gauge (``other``)."""
MAX_SLO_P95_S = 120.0
"""The largest finite bucket of the latency histograms (server/metrics.py LATENCY_BUCKETS): a p95 computed from
them never reads above it, so a larger threshold could never be crossed."""


class TenantLimits(BaseModel):
    """What one tenant may ask; every limit unset (None) is no limit beyond the profile's own."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    in_flight: int | None = Field(None, ge=1, le=10_000)
    """Generation requests (every generation route: txt2img, img2img, generations, edits, variations) the tenant
    may have in flight at once, all its keys together; more get 429. Unset: ``auth.per_key_concurrency``."""
    images_queued: int | None = Field(None, ge=1, le=1_000_000)
    """Images of the tenant's admitted requests not finished yet (queued or running); a request that would go over
    gets 429 (a request asking more than this at once: 400)."""
    images_per_minute: float | None = Field(None, gt=0, le=1_000_000)
    """Token bucket: images the tenant may start per minute on average; a request without enough tokens gets 429
    with ``Retry-After`` the seconds until the bucket holds enough. Unset: no rate limit."""
    burst: int | None = Field(None, ge=1, le=1_000_000)
    """The bucket's capacity: images at once after an idle spell (a request asking more: 400). Unset: a minute's
    worth, ``images_per_minute``."""
    max_width: int | None = Field(None, ge=8, le=65_536)
    """Largest image width the tenant may ask (400 naming the size over it), below the profile's own bound."""
    max_height: int | None = Field(None, ge=8, le=65_536)
    """Largest image height the tenant may ask (400 naming the size over it)."""
    max_pixels: int | None = Field(None, ge=64, le=1 << 32)
    """Largest width x height the tenant may ask (400 naming the size over it)."""
    max_steps: int | None = Field(None, ge=1, le=10_000)
    """Most denoising steps the tenant may ask (400 naming steps)."""

    @property
    def capacity(self) -> int | None:
        """The token bucket's size in images (None without a rate limit)."""
        if self.images_per_minute is None:
            return None
        return self.burst if self.burst is not None else max(1, int(self.images_per_minute))


class TenantSlo(BaseModel):
    """What a tenant is promised, judged per tenant by the alert and the rollout analysis (issue 52 point 5)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    p95_s: float | None = Field(None, gt=0, le=MAX_SLO_P95_S)
    """The tenant's generation p95 (end-to-end seconds, over 5 minutes, all replicas) above which
    ``SdserveTenantP95SloBurn`` fires and the preview analysis fails; exported as
    ``sdserve_tenant_slo_p95_seconds{tenant}``. Unset: ``DEFAULT_SLO_P95_S`` (30 s). At most 120 s, the latency
    histogram's largest finite bucket."""

    @property
    def threshold_p95_s(self) -> float:
        """The p95 threshold in force: the tenant's own, else the server-wide default."""
        return self.p95_s if self.p95_s is not None else DEFAULT_SLO_P95_S


class TenantConfig(BaseModel):
    """One ``[[auth.tenants]]`` entry (or one ``[[tenants]]`` entry of ``auth.tenants_file``)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    label: str
    """The tenant's name in logs, metrics, /capabilities and the scheduler (never a key): 1-63 of letters, digits,
    ``_ . -``; not 8 lowercase hex characters (those name unconfigured keys)."""
    digests: tuple[str, ...] = ()
    """sha256 hex digests of the tenant's API keys (or Basic ``user:pass``), as ``auth.api_key_sha256``; a digest
    in two tenants is refused. Only the ``default`` tenant (the limits of a server without auth) may have none."""
    weight: float = Field(1.0, gt=0, le=1000)
    """Share of the engine against other tenants with work queued (weighted fair queueing: 2 gets twice the
    denoising work of 1 while both wait); unconfigured keys weigh 1."""
    limits: TenantLimits = TenantLimits()
    """The tenant's limits and quotas."""
    slo: TenantSlo = TenantSlo()
    """The tenant's SLO, e.g. ``slo = { p95_s = 10.0 }``."""
    lora_refresh: bool = False
    """The tenant may rescan the shared LoRA library (``POST /sdapi/v1/refresh-loras``); otherwise 403 naming this
    setting. Listings (``GET /sdapi/v1/loras``) are shared read-only with every tenant. Without auth every caller
    may; with auth but no tenant bound to a key, every key may (as before tenants); a key in no tenant, once some
    tenant names keys, may not."""

    @field_validator("label")
    @classmethod
    def _label(cls, value: str) -> str:
        if not _LABEL.fullmatch(value):
            raise ValueError(f"tenant label {value!r}: 1-63 characters of letters, digits, '_', '.', '-', starting "
                             "with a letter or digit")
        if _KEY_ID.fullmatch(value):
            raise ValueError(f"tenant label {value!r}: 8 lowercase hex characters name an unconfigured key's id; "
                             "choose another label")
        return value

    @model_validator(mode="after")
    def _digests(self) -> TenantConfig:
        for digest in self.digests:
            if not _DIGEST.fullmatch(digest):
                raise ValueError(f"tenant {self.label!r}: digests must be lowercase sha256 hex digests (64 chars), "
                                 "e.g. printf %s \"$KEY\" | sha256sum")
        if not self.digests and self.label != DEFAULT_TENANT:
            raise ValueError(f"tenant {self.label!r} has no digests: name its keys' sha256 digests (only the "
                             f"{DEFAULT_TENANT!r} tenant, a server without auth, has none)")
        return self


class TenantsFile(BaseModel):
    """The tenants file (``auth.tenants_file``): TOML ``[[tenants]]`` tables or JSON ``{"tenants": [...]}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    tenants: tuple[TenantConfig, ...] = ()


def check_tenants(tenants: Sequence[TenantConfig]) -> None:
    """ValueError for a label given twice or a key digest in two tenants (naming the labels, never the digest)."""
    labels: set[str] = set()
    owners: dict[str, str] = {}
    for tenant in tenants:
        if tenant.label in labels:
            raise ValueError(f"tenant label {tenant.label!r} is configured twice")
        labels.add(tenant.label)
        for digest in tenant.digests:
            other = owners.setdefault(digest, tenant.label)
            if other != tenant.label:
                raise ValueError(f"a key digest (id {digest[:8]}) is in two tenants, {other!r} and "
                                 f"{tenant.label!r}: a key belongs to one tenant")
