"""Per-tenant observability (issue 52 point 5): series labelled by a closed set (configured labels, ``other``,
``default`` without auth), never a key, key id or prompt; 429s by the limit refusing them; plus the small fixes
beside it: the OpenAPI document shows auth for a tenants-only config, a url link fetch with a valid key names its
tenant (never refused), and admission prices a request's wait for its own tenant."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import io
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from prometheus_client import generate_latest

from engines.errors import ConfigError
from engines.types.model import ModelInfo
from server.exitcodes import ExitCode, exit_code_for
from server.metrics import Metrics, tenant_series
from server.middleware import AuthMiddleware, MetricsMiddleware, Receive, Scope, Send, tenant_label
from server.settings import AuthSettings, load_settings
from server.tenant_config import DEFAULT_SLO_P95_S, TenantConfig, TenantLimits, TenantSlo
from server.tenants import TenantRegistry
from tests.unit.fakes import HashedEngine
from tests.unit.fakes import start as _start

KEY_A, KEY_B, KEY_C = "sk-metrics-a", "sk-metrics-b", "sk-metrics-unconfigured"
GEN = "/v1/images/generations"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def _auth(**limits: Any) -> AuthSettings:
    return AuthSettings(api_key_sha256=(_sha(KEY_C),),
                        tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A),), limits=TenantLimits(**limits)),
                                 TenantConfig(label="team-b", digests=(_sha(KEY_B),))))


@pytest.fixture
def app(engine: HashedEngine) -> Iterator[TestClient]:
    yield from _start(engine, load_settings("dev").model_copy(
        update={"auth": _auth(images_per_minute=60, burst=2)}))


def _value(client: TestClient, name: str, **labels: str) -> float:
    metrics: Metrics = client.app.state.metrics  # type: ignore[attr-defined]
    return metrics.registry.get_sample_value(name, labels) or 0.0


def _gen(client: TestClient, key: str, n: int = 1) -> Any:
    return client.post(GEN, json={"prompt": "a secret prompt", "steps": 2, "size": "64x64", "n": n},
                       headers=_bearer(key))


def test_tenant_series_take_a_closed_set_of_labels() -> None:
    assert tenant_series("team-a", {"team-a"}, auth=True) == "team-a"
    assert tenant_series(_sha(KEY_C)[:8], {"team-a"}, auth=True) == "other"
    assert tenant_series(None, {"team-a"}, auth=True) == "other"
    assert tenant_series("team-a", {"team-a"}, auth=False) == "default"


def test_a_configured_tenant_and_an_unconfigured_key_get_their_own_series(app: TestClient) -> None:
    assert _gen(app, KEY_A, n=2).status_code == 200
    assert _gen(app, KEY_C).status_code == 200
    route = {"route": GEN}
    for tenant, images in (("team-a", 2.0), ("other", 1.0)):
        assert _value(app, "sdserve_tenant_requests_total", tenant=tenant, status="200", **route) == 1.0
        assert _value(app, "sdserve_tenant_request_duration_seconds_count", tenant=tenant, **route) == 1.0
        assert _value(app, "sdserve_tenant_images_generated_total", tenant=tenant) == images
        assert _value(app, "sdserve_tenant_queue_wait_seconds_count", tenant=tenant) == 1.0
    assert _value(app, "sdserve_tenant_requests_total", tenant="team-b", status="200", **route) == 0.0
    assert _value(app, "sdserve_requests_total", status="200", **route) == 2.0  # the server-wide series as before
    text = app.get("/metrics").text
    assert 'tenant="team-a"' in text and 'tenant="other"' in text
    for secret in (KEY_A, KEY_C, _sha(KEY_A)[:8], _sha(KEY_C)[:8], "a secret prompt"):
        assert secret not in text
    assert app.get("/v1/models").status_code == 401  # no valid key: counted as other
    assert _value(app, "sdserve_tenant_requests_total", tenant="other", route="unmatched", status="401") + \
        _value(app, "sdserve_tenant_requests_total", tenant="other", route="/v1/models", status="401") == 1.0


def test_a_429_over_a_tenant_limit_is_counted_by_that_limit(app: TestClient) -> None:
    assert _gen(app, KEY_A, n=2).status_code == 200  # the burst of 2 taken
    refused = _gen(app, KEY_A)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "images_per_minute"
    assert _value(app, "sdserve_tenant_rate_limited_total", tenant="team-a", limit="images_per_minute") == 1.0
    assert _value(app, "sdserve_tenant_requests_total", tenant="team-a", route=GEN, status="429") == 1.0
    assert _gen(app, KEY_B).status_code == 200
    assert _value(app, "sdserve_tenant_rate_limited_total", tenant="team-b", limit="images_per_minute") == 0.0


def test_an_admission_refusal_is_counted_as_the_estimated_wait(app: TestClient) -> None:
    assert _gen(app, KEY_B).status_code == 200  # the cost model learns this shape
    service = app.app.state.service  # type: ignore[attr-defined]
    service.batcher.ahead_seconds = lambda costs=None, owner=None: 10_000.0  # work ahead no deadline outlasts
    refused = _gen(app, KEY_B)
    assert refused.status_code == 429 and "estimated wait" in refused.json()["error"]["message"]
    assert _value(app, "sdserve_tenant_rate_limited_total", tenant="team-b", limit="estimated_wait") == 1.0


class Held:
    """An app that answers 200 after ``release``; records each request's tenant."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.tenants: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.tenants.append(tenant_label(scope))
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def test_the_in_flight_cap_is_counted_by_its_limit() -> None:
    metrics, held = Metrics(), Held()
    app = MetricsMiddleware(AuthMiddleware(held, TenantRegistry(_auth(in_flight=1)), exempt=()), metrics)

    async def scenario() -> int:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            first = asyncio.ensure_future(client.post(GEN, json={}, headers=_bearer(KEY_A)))
            while not held.tenants:
                await asyncio.sleep(0)
            second = await client.post(GEN, json={}, headers=_bearer(KEY_A))
            held.release.set()
            await first
            return second.status_code

    assert asyncio.run(scenario()) == 429
    assert metrics.registry.get_sample_value("sdserve_tenant_rate_limited_total",
                                             {"tenant": "team-a", "limit": "in_flight"}) == 1.0


def test_without_auth_every_series_is_the_default_tenants(engine: HashedEngine) -> None:
    for client in _start(engine, load_settings("dev")):
        assert _gen(client, "any").status_code == 200
        assert _value(client, "sdserve_tenant_images_generated_total", tenant="default") == 1.0
        assert _value(client, "sdserve_tenant_requests_total", tenant="default", route=GEN, status="200") == 1.0


def test_a_link_fetch_with_a_valid_key_names_its_tenant_and_is_never_refused() -> None:
    held = Held()
    held.release.set()
    app = AuthMiddleware(held, TenantRegistry(_auth()), exempt=())
    path = "/v1/images/files/" + "0" * 32 + ".png"

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return [(await client.get(path, headers=h)).status_code
                    for h in (_bearer(KEY_A), _bearer(KEY_C), _bearer("sk-wrong"), {})]

    assert asyncio.run(scenario()) == [200, 200, 200, 200]
    # A key that is none of the accepted ones names no tenant (the route then serves it as a keyless fetch).
    assert held.tenants == ["team-a", _sha(KEY_C)[:8], "default", "default"]


def test_the_openapi_document_shows_auth_for_a_tenants_only_config(engine: HashedEngine) -> None:
    auth = AuthSettings(tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A),)),))
    assert not auth.api_key_sha256 and auth.enabled
    for client in _start(engine, load_settings("dev").model_copy(update={"auth": auth})):
        spec = client.get("/openapi.json", headers=_bearer(KEY_A)).json()
        assert spec["paths"][GEN]["post"]["security"] == [{"bearerAuth": []}, {"basicAuth": []}]
        assert spec["paths"]["/health"]["get"]["security"] == []


class EditEngine(HashedEngine):
    """The fake as a model that serves img2img too (A1111's img2img admits before decoding its images)."""

    @property
    def info(self) -> ModelInfo:
        info = super().info
        return dataclasses.replace(info, modes=("txt2img", "img2img"), edit_schedulers=info.schedulers)


def test_admission_prices_the_wait_for_the_requests_own_tenant() -> None:
    for app in _start(EditEngine(), load_settings("dev").model_copy(update={"auth": _auth()})):
        _wait_is_priced_for_its_tenant(app)


def _wait_is_priced_for_its_tenant(app: TestClient) -> None:
    service = app.app.state.service  # type: ignore[attr-defined]
    owners: list[str | None] = []
    real = service.batcher.ahead_seconds

    def spy(costs: Any = None, owner: str | None = None) -> float:
        owners.append(owner)
        return float(real(costs, owner))

    service.batcher.ahead_seconds = spy
    assert _gen(app, KEY_B).status_code == 200
    assert _gen(app, KEY_C).status_code == 200
    assert owners == ["team-b", _sha(KEY_C)[:8]]
    owners.clear()  # img2img admits before decoding (preadmit from the route, no owner passed): the request's tenant
    image = io.BytesIO()
    Image.new("RGB", (64, 64), (9, 9, 9)).save(image, format="PNG")
    body = {"prompt": "p", "steps": 2, "init_images": [base64.b64encode(image.getvalue()).decode()]}
    assert app.post("/sdapi/v1/img2img", json=body, headers=_bearer(KEY_A)).status_code == 200
    assert owners and set(owners) == {"team-a"}


# ---- per-tenant SLOs: config, the gauge, /capabilities ----------------------------------------------------------

SLO = "sdserve_tenant_slo_p95_seconds"


def _exposed_slos(metrics: Metrics) -> dict[str, float]:
    """The SLO gauge as /metrics renders it (the real prometheus_client text exposition)."""
    text = generate_latest(metrics.registry).decode()
    return {m[1]: float(m[2]) for m in re.finditer(rf'^{SLO}{{tenant="([^"]+)"}} (\S+)$', text, re.MULTILINE)}


def _tenants_json(*tenants: tuple[str, str, dict[str, Any]]) -> str:
    return json.dumps({"tenants": [{"label": label, "digests": [_sha(key)], **extra}
                                   for label, key, extra in tenants]})


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_the_slo_gauge_follows_boot_and_every_successful_reload(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """At boot: each configured tenant's own p95 (profile and file), 30 s where unset, nothing for unconfigured
    keys (``other``: the alert's fallback). A reload that changes one and removes another: the removed one loses
    its series. A reload with a bad value: refused naming the field, the gauge as before."""
    path, clock = tmp_path / "tenants.json", Clock()
    path.write_text(_tenants_json(("team-a", KEY_A, {"slo": {"p95_s": 10.0}}), ("team-b", KEY_B, {})))
    auth = AuthSettings(api_key_sha256=(_sha(KEY_C),), tenants_file=str(path), tenants_reload_s=1.0,
                        tenants=(TenantConfig(label="team-p", digests=(_sha("sk-p"),), slo=TenantSlo(p95_s=5.0)),))
    registry, metrics = TenantRegistry(auth, clock), Metrics()
    registry.watch_slos(metrics.set_tenant_slos)
    assert _exposed_slos(metrics) == {"team-p": 5.0, "team-a": 10.0, "team-b": DEFAULT_SLO_P95_S}
    path.write_text(_tenants_json(("team-a", KEY_A, {"slo": {"p95_s": 15.5}}), ("team-c", "sk-c2", {})))
    clock.now += 1
    registry.refresh()
    assert _exposed_slos(metrics) == {"team-p": 5.0, "team-a": 15.5, "team-c": DEFAULT_SLO_P95_S}
    caplog.set_level(logging.ERROR, logger="server.tenants")
    path.write_text(_tenants_json(("team-a", KEY_A, {"slo": {"p95_s": -1}})))
    clock.now += 1
    registry.refresh()
    assert "tenants.0.slo.p95_s" in str(registry.snapshot()["file"]["error"]) and "stay in force" in caplog.text
    assert _exposed_slos(metrics) == {"team-p": 5.0, "team-a": 15.5, "team-c": DEFAULT_SLO_P95_S}


def test_without_auth_the_default_tenants_slo_is_its_series() -> None:
    """Without auth every request is ``default``: a configured ``default`` tenant's SLO is that series'."""
    registry, metrics = TenantRegistry(AuthSettings(tenants=(
        TenantConfig(label="default", slo=TenantSlo(p95_s=12.0)),))), Metrics()
    assert not registry.enabled
    registry.watch_slos(metrics.set_tenant_slos)
    assert _exposed_slos(metrics) == {"default": 12.0}
    assert registry.slos() == {"default": 12.0} and TenantRegistry(AuthSettings()).slos() == {}


def _profile(tmp_path: Path, tenant: str) -> Path:
    text = (Path(__file__).resolve().parents[2] / "configs" / "dev.toml").read_text()
    path = tmp_path / "dev.toml"
    path.write_text(f'{text}\n[auth]\n[[auth.tenants]]\nlabel = "team-a"\ndigests = ["{_sha(KEY_A)}"]\n{tenant}')
    return path


@pytest.mark.parametrize(("slo", "fragment"), [
    ("slo = { p95_s = -1.0 }", "auth.tenants.0.slo.p95_s"),
    ("slo = { p95_s = 0 }", "auth.tenants.0.slo.p95_s"),
    ("slo = { p95_s = 121 }", "auth.tenants.0.slo.p95_s"),
    ("slo = { p99_s = 5.0 }", "auth.tenants.0.slo.p99_s"),
    ("slo_p95_s = 5.0", "auth.tenants.0.slo_p95_s"),
])
def test_a_bad_slo_is_refused_at_boot_naming_the_field(tmp_path: Path, slo: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings("dev", _profile(tmp_path, slo))
    assert fragment in str(err.value) and exit_code_for(err.value) == ExitCode.CONFIG_INVALID


def test_an_slo_loads_from_the_profile_and_shows_in_capabilities(engine: HashedEngine, tmp_path: Path) -> None:
    settings = load_settings("dev", _profile(tmp_path, "[auth.tenants.slo]\np95_s = 10.0\n"))
    assert settings.auth.tenants[0].slo.p95_s == 10.0
    auth = settings.auth.model_copy(update={"tenants": (*settings.auth.tenants,
                                                        TenantConfig(label="team-b", digests=(_sha(KEY_B),)))})
    for client in _start(engine, load_settings("dev").model_copy(update={"auth": auth})):
        response = client.get("/capabilities", headers=_bearer(KEY_A))
        section = response.json()["tenants"]
        assert [(t["label"], t["slo"]) for t in section["tenants"]] == [
            ("team-a", {"p95_s": 10.0, "default": False}), ("team-b", {"p95_s": DEFAULT_SLO_P95_S, "default": True})]
        assert section["unconfigured_keys"]["slo"] == {"p95_s": DEFAULT_SLO_P95_S, "default": True}
        assert _sha(KEY_A) not in response.text and _sha(KEY_B) not in response.text


def test_the_app_exports_each_configured_tenants_slo_on_metrics(app: TestClient) -> None:
    """server/app.py wires the registry to the gauge: /metrics (the real exposition) has one SLO series per
    configured tenant, the 30 s default where unset, none for ``other``."""
    text = app.get("/metrics").text
    for label in ("team-a", "team-b"):
        assert f'sdserve_tenant_slo_p95_seconds{{tenant="{label}"}} {DEFAULT_SLO_P95_S}' in text, text[-2000:]
    assert 'sdserve_tenant_slo_p95_seconds{tenant="other"}' not in text
