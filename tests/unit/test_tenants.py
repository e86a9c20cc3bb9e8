"""Tenants (issue 52 points 1 and 3): [[auth.tenants]] and the reloadable tenants file, refused at boot when wrong,
kept when a reload is wrong; the token bucket on an injected clock; the quotas; the tenant on the request, in the
access log and in /capabilities; the cap on requests in flight counting every generation route."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import Request
from fastapi.testclient import TestClient

from engines.errors import ConfigError, InvalidRequestError
from engines.types.request import Batch, ImageSpec
from server.errors import TenantLimitError, error_response
from server.exitcodes import ExitCode, exit_code_for
from server.middleware import AuthMiddleware, Receive, Scope, Send, tenant_label
from server.settings import AuthSettings, load_settings
from server.tenant_config import DEFAULT_TENANT, TenantConfig, TenantLimits
from server.tenants import REQUEST, RequestCharge, TenantQuotas, TenantRegistry, TokenBucket
from tests.unit.fakes import HashedEngine
from tests.unit.fakes import start as _start

KEY_A, KEY_B, KEY_C = "sk-tenant-a", "sk-tenant-b", "sk-unconfigured"
GEN = "/v1/images/generations"


def _sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _profile(tmp_path: Path, auth: str) -> Path:
    """The dev profile with ``auth`` as its [auth] table."""
    text = (Path(__file__).resolve().parents[2] / "configs" / "dev.toml").read_text()
    path = tmp_path / "dev.toml"
    path.write_text(text + "\n[auth]\n" + auth)
    return path


# ---- configuration ------------------------------------------------------------------------------------------

def test_tenants_load_from_the_profile(tmp_path: Path) -> None:
    settings = load_settings("dev", _profile(tmp_path, f'''
[[auth.tenants]]
label = "team-a"
digests = ["{_sha(KEY_A)}"]
weight = 2.0
[auth.tenants.limits]
in_flight = 3
images_per_minute = 30
max_steps = 20
'''))
    (tenant,) = settings.auth.tenants
    assert (tenant.label, tenant.weight, tenant.limits.in_flight, tenant.limits.capacity) == ("team-a", 2.0, 3, 30)
    assert settings.auth.enabled


@pytest.mark.parametrize(("auth", "fragment"), [
    (f'[[auth.tenants]]\nlabel = "a"\ndigests = ["{_sha(KEY_A)}"]\nshare = 2\n', "auth.tenants.0.share"),
    (f'[[auth.tenants]]\nlabel = "a"\ndigests = ["{_sha(KEY_A)}"]\n[auth.tenants.limits]\nrpm = 2\n',
     "auth.tenants.0.limits.rpm"),
    (f'[[auth.tenants]]\nlabel = "a"\ndigests = ["{_sha(KEY_A)}"]\n[[auth.tenants]]\nlabel = "b"\n'
     f'digests = ["{_sha(KEY_A)}"]\n', "in two tenants, 'a' and 'b'"),
    (f'[[auth.tenants]]\nlabel = "a"\ndigests = ["{_sha(KEY_A)}"]\n[[auth.tenants]]\nlabel = "a"\n'
     f'digests = ["{_sha(KEY_B)}"]\n', "configured twice"),
    (f'[[auth.tenants]]\nlabel = "{_sha(KEY_A)[:8]}"\ndigests = ["{_sha(KEY_A)}"]\n', "unconfigured key's id"),
    ('[[auth.tenants]]\nlabel = "a"\n', "has no digests"),
    (f'[[auth.tenants]]\nlabel = "a"\ndigests = ["{_sha(KEY_A)}"]\nweight = 0\n', "auth.tenants.0.weight"),
])
def test_bad_tenants_are_refused_at_boot_naming_the_field(tmp_path: Path, auth: str, fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_settings("dev", _profile(tmp_path, auth))
    assert fragment in str(err.value) and _sha(KEY_A) not in str(err.value)
    assert exit_code_for(err.value) == ExitCode.CONFIG_INVALID and int(ExitCode.CONFIG_INVALID) == 10


def _file_tenants(*tenants: tuple[str, str, dict[str, Any]]) -> str:
    return json.dumps({"tenants": [{"label": label, "digests": [_sha(key)], "limits": limits}
                                   for label, key, limits in tenants]})


def test_tenants_file_json_toml_and_a_secret_folder(tmp_path: Path) -> None:
    folder = tmp_path / "secret"
    folder.mkdir()
    (folder / "a.json").write_text(_file_tenants(("team-a", KEY_A, {"max_steps": 10})))
    (folder / "b.toml").write_text(f'[[tenants]]\nlabel = "team-b"\ndigests = ["{_sha(KEY_B)}"]\nweight = 3\n')
    (folder / "..data").mkdir()  # a Secret's own entries are skipped
    (folder / "README").write_text("not a tenants file")
    registry = TenantRegistry(AuthSettings(tenants_file=str(folder), api_key_sha256=(_sha(KEY_C),)))
    assert registry.label_for(_sha(KEY_A)) == "team-a" and registry.label_for(_sha(KEY_B)) == "team-b"
    assert registry.label_for(_sha(KEY_C)) == _sha(KEY_C)[:8]  # an unconfigured key is its own tenant
    assert set(registry.current.digests) == {_sha(KEY_A), _sha(KEY_B), _sha(KEY_C)}
    assert dict(registry.weights) == {"team-a": 1.0, "team-b": 3.0} and registry.weights.get("x", 1.0) == 1.0
    assert registry.limits("team-a").max_steps == 10 and registry.limits("nobody") == TenantLimits()


@pytest.mark.parametrize(("content", "fragment"), [
    (json.dumps({"tenants": [{"label": "a", "digests": [_sha(KEY_A)], "colour": 1}]}), "tenants.0.colour"),
    ("not json", "tenants.json"),
])
def test_a_bad_tenants_file_at_boot_is_exit_10(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        TenantRegistry(AuthSettings(tenants_file=str(path)))
    assert fragment in str(err.value) and exit_code_for(err.value) == ExitCode.CONFIG_INVALID
    with pytest.raises(ConfigError, match="not found"):
        TenantRegistry(AuthSettings(tenants_file=str(tmp_path / "missing.toml")))


def test_a_digest_in_the_profile_and_the_file_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "tenants.json"
    path.write_text(_file_tenants(("team-b", KEY_A, {})))
    auth = AuthSettings(tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A),)),), tenants_file=str(path))
    with pytest.raises(ConfigError, match="in two tenants, 'team-a' and 'team-b'"):
        TenantRegistry(auth)


def test_the_tenants_file_is_reloaded_on_change_and_a_bad_reload_keeps_the_old(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path, clock = tmp_path / "tenants.json", Clock()
    path.write_text(_file_tenants(("team-a", KEY_A, {"in_flight": 2})))
    registry = TenantRegistry(AuthSettings(tenants_file=str(path), tenants_reload_s=5.0), clock)
    path.write_text(_file_tenants(("team-a", KEY_A, {"in_flight": 4}), ("team-b", KEY_B, {})))
    registry.refresh()  # within the interval: not checked yet
    assert registry.in_flight_cap("team-a") == 2 and registry.label_for(_sha(KEY_B)) == _sha(KEY_B)[:8]
    clock.now += 5
    registry.refresh()
    assert registry.in_flight_cap("team-a") == 4 and registry.label_for(_sha(KEY_B)) == "team-b"
    assert registry.snapshot()["file"] == {"reload_s": 5.0, "reloads": 1, "error": None}
    caplog.set_level(logging.ERROR, logger="server.tenants")
    path.write_text(_file_tenants(("team-a", KEY_A, {}), ("team-b", KEY_A, {})))  # a key in two tenants
    clock.now += 5
    registry.refresh()
    assert registry.in_flight_cap("team-a") == 4 and registry.label_for(_sha(KEY_B)) == "team-b"  # kept
    error = registry.snapshot()["file"]["error"]
    assert "in two tenants" in error and "previous 2 tenant(s) stay in force" in caplog.text
    path.write_text(_file_tenants(("team-a", KEY_A, {"in_flight": 1})))
    clock.now += 5
    registry.refresh()
    assert registry.in_flight_cap("team-a") == 1 and registry.snapshot()["file"]["error"] is None
    assert registry.label_for(_sha(KEY_B)) == _sha(KEY_B)[:8] and _sha(KEY_B) not in registry.current.digests


# ---- the token bucket and the quotas -------------------------------------------------------------------------

def test_token_bucket_on_an_injected_clock() -> None:
    bucket = TokenBucket(rate=0.5, capacity=4, now=0.0)
    assert bucket.take(3, 0.0) == 0.0
    assert bucket.take(3, 0.0) == pytest.approx(4.0)  # 1 left, 2 more at 0.5/s: 4 s; nothing taken
    assert bucket.take(3, 3.9) > 0
    assert bucket.take(3, 4.0) == 0.0
    assert bucket.take(100, 1000.0) == pytest.approx((100 - 4) / 0.5)  # refills to capacity, never past it
    assert bucket.take(6, 1000.0, force=True) == 0.0 and bucket.tokens == -2  # a debt delays the next
    assert bucket.wait_s(1, 1000.0) == pytest.approx(6.0)


def _batch(n: int = 1, steps: int = 4, size: int = 64) -> Batch:
    return Batch(tuple(ImageSpec(prompt="p", seed=i) for i in range(n)), steps=steps, width=size, height=size)


def _quotas(limits: TenantLimits, clock: Clock) -> TenantQuotas:
    auth = AuthSettings(tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A),), limits=limits),))
    return TenantQuotas(TenantRegistry(auth, clock), clock)


def test_images_per_minute_refuses_with_retry_after_then_recovers() -> None:
    clock = Clock()
    quotas = _quotas(TenantLimits(images_per_minute=30, burst=4), clock)  # 0.5 image/s
    with quotas.admit("team-a", 4):
        pass
    with pytest.raises(TenantLimitError) as err, quotas.admit("team-a", 2):
        pass
    assert (err.value.limit, err.value.retry_after) == ("images_per_minute", 4)
    assert "images_per_minute" in str(err.value) and "team-a" in str(err.value)
    with quotas.admit("someone-else", 50):  # another tenant: no limits of its own
        pass
    clock.now += 4
    with quotas.admit("team-a", 2):
        pass
    with pytest.raises(InvalidRequestError, match="burst") as never, quotas.admit("team-a", 5):
        pass
    assert never.value.param == "n"  # more than the bucket holds can never pass: a 400, not a 429


def test_images_queued_counts_admitted_images_until_they_finish() -> None:
    quotas = _quotas(TenantLimits(images_queued=4), Clock())
    with quotas.admit("team-a", 3):
        with pytest.raises(TenantLimitError) as err, quotas.admit("team-a", 2):
            pass
        assert err.value.limit == "images_queued" and quotas.queued["team-a"] == 3
        with quotas.admit("team-a", 1):
            assert quotas.queued["team-a"] == 4
    assert quotas.queued["team-a"] == 0
    with pytest.raises(InvalidRequestError, match="images_queued"), quotas.admit("team-a", 5):
        pass


def test_a_request_is_refused_whole_never_half_way() -> None:
    """A Hires fix's second pass (or a later n_iter batch) of an admitted request is charged, never refused."""
    clock = Clock()
    quotas = _quotas(TenantLimits(images_per_minute=60, burst=2, images_queued=2), clock)

    async def one_request() -> None:
        token = REQUEST.set(RequestCharge())
        try:
            with quotas.admit("team-a", 2), quotas.admit("team-a", 2):  # the same request again: over both
                pass
        finally:
            REQUEST.reset(token)

    asyncio.run(one_request())
    bucket = quotas._buckets["team-a"]  # noqa: SLF001 (the test reads the debt)
    assert bucket.tokens == -2
    with pytest.raises(TenantLimitError) as err, quotas.admit("team-a", 1):
        pass
    assert err.value.retry_after == 3  # the debt of 2 and this image, at 1 image/s


def test_largest_size_and_steps_are_400_naming_the_field() -> None:
    quotas = _quotas(TenantLimits(max_width=64, max_height=96, max_pixels=64 * 64, max_steps=10), Clock())
    quotas.check_shape("team-a", [_batch(steps=10)])
    for batch, param, fragment in ((_batch(steps=11), "steps", "10 steps, got 11"),
                                   (_batch(size=128), "size", "width 64, got 128x128")):
        with pytest.raises(InvalidRequestError, match=fragment) as err:
            quotas.check_shape("team-a", [batch])
        assert err.value.param == param
    quotas.check_shape("other", [_batch(steps=50, size=512)])


def test_a_tenant_limit_is_429_with_retry_after_naming_the_limit_on_both_apis() -> None:
    exc = TenantLimitError("tenant 'a' is over its images_per_minute limit", 7, "images_per_minute")
    for path in (GEN, "/sdapi/v1/txt2img"):
        response = error_response(exc, path)
        assert response.status_code == 429 and response.headers["retry-after"] == "7"
        body = json.loads(bytes(response.body))["error"]
        assert body["code"] == "images_per_minute" and "images_per_minute" in body["message"]
        assert body["type"] == "rate_limit_exceeded"


# ---- the auth middleware: the tenant on the request, the cap on requests in flight ---------------------------

class Held:
    """An app that answers after ``release``; records each request's tenant."""

    def __init__(self) -> None:
        self.release, self.entered = asyncio.Event(), asyncio.Event()
        self.tenants: list[str] = []

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self.tenants.append(tenant_label(scope))
        self.entered.set()
        await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})


def _post(client: httpx.AsyncClient, path: str, key: str) -> Any:
    return client.post(path, json={}, headers=_bearer(key))


@pytest.mark.parametrize("path", ["/sdapi/v1/img2img", "/v1/images/edits", "/v1/images/variations",
                                  "/sdapi/v1/txt2img", GEN])
def test_the_in_flight_cap_counts_every_generation_route_per_tenant(path: str) -> None:
    auth = AuthSettings(api_key_sha256=(_sha(KEY_C),), per_key_concurrency=1,
                        tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A), _sha(KEY_B))),))

    async def scenario() -> list[Any]:
        held = Held()
        app = AuthMiddleware(held, TenantRegistry(auth), exempt=("/health",))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            first = asyncio.ensure_future(_post(client, path, KEY_A))
            await held.entered.wait()
            second = await _post(client, path, KEY_B)  # another key of the same tenant: its cap is shared
            other = asyncio.ensure_future(_post(client, path, KEY_C))  # another tenant is not capped by it
            while len(held.tenants) < 2:
                await asyncio.sleep(0)
            held.release.set()
            return [await first, second, await other, held.tenants]

    first, second, other, tenants = asyncio.run(scenario())
    assert (first.status_code, second.status_code, other.status_code) == (200, 429, 200)
    assert second.json()["error"]["code"] == "in_flight" and second.headers["retry-after"] == "1"
    assert "team-a" in second.json()["error"]["message"]
    assert tenants == ["team-a", _sha(KEY_C)[:8]]


def test_without_auth_every_request_is_the_default_tenant_uncapped() -> None:
    async def scenario() -> tuple[list[int], list[str]]:
        held = Held()
        app = AuthMiddleware(held, TenantRegistry(AuthSettings(per_key_concurrency=1)), exempt=())
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            calls = [asyncio.ensure_future(client.post(GEN, json={})) for _ in range(3)]
            while len(held.tenants) < 3:
                await asyncio.sleep(0)
            held.release.set()
            return [(await c).status_code for c in calls], held.tenants

    codes, tenants = asyncio.run(scenario())
    assert codes == [200, 200, 200] and tenants == [DEFAULT_TENANT] * 3
    assert tenant_label({"state": {}}) == DEFAULT_TENANT


# ---- through the app: quotas, /capabilities, the access log ------------------------------------------------

@pytest.fixture
def tenants_app(engine: HashedEngine) -> Iterator[TestClient]:
    limits = TenantLimits(images_per_minute=60, burst=2, max_steps=8)
    auth = AuthSettings(api_key_sha256=(_sha(KEY_C),),
                        tenants=(TenantConfig(label="team-a", digests=(_sha(KEY_A),), weight=2.0, limits=limits),
                                 TenantConfig(label="team-b", digests=(_sha(KEY_B),))))
    yield from _start(engine, load_settings("dev").model_copy(update={"auth": auth}))


def _gen(client: TestClient, key: str, n: int = 1, steps: int = 2, path: str = GEN) -> Any:
    body: dict[str, Any] = {"prompt": "p", "steps": steps, "size": "64x64", "n": n} if path == GEN else \
        {"prompt": "p", "steps": steps, "width": 64, "height": 64, "batch_size": n}
    return client.post(path, json=body, headers=_bearer(key))


def test_quotas_through_the_app(tenants_app: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    tenants_app.app.state.service.quotas.clock = clock  # type: ignore[attr-defined]
    assert _gen(tenants_app, KEY_A, n=2).status_code == 200
    refused = _gen(tenants_app, KEY_A)
    assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "images_per_minute"
    a1111 = _gen(tenants_app, KEY_A, path="/sdapi/v1/txt2img")
    assert a1111.status_code == 429 and a1111.json()["error"]["code"] == "images_per_minute"
    assert _gen(tenants_app, KEY_B, n=4).status_code == 200  # another tenant is served meanwhile
    clock.now += 1
    assert _gen(tenants_app, KEY_A).status_code == 200
    too_long = _gen(tenants_app, KEY_A, steps=9)
    assert too_long.status_code == 400 and too_long.json()["error"]["param"] == "steps"
    assert _gen(tenants_app, KEY_A, steps=9, path="/sdapi/v1/txt2img").status_code == 422
    caplog.set_level(logging.INFO, logger="sdserve.access")
    assert _gen(tenants_app, KEY_C, steps=9).status_code == 200
    line = [r.access for r in caplog.records if r.name == "sdserve.access"][-1]  # type: ignore[attr-defined]
    assert line["tenant"] == _sha(KEY_C)[:8] and KEY_C not in caplog.text


def test_capabilities_show_labels_weights_and_limits_never_digests(tenants_app: TestClient) -> None:
    response = tenants_app.get("/capabilities", headers=_bearer(KEY_B))
    section = response.json()["tenants"]
    assert [(t["label"], t["weight"]) for t in section["tenants"]] == [("team-a", 2.0), ("team-b", 1.0)]
    assert section["tenants"][0]["limits"] == {"images_per_minute": 60.0, "burst": 2, "max_steps": 8}
    assert section["auth"] is True and section["file"] is None
    for key in (KEY_A, KEY_B, KEY_C):
        assert _sha(key) not in response.text and _sha(key)[:8] not in json.dumps(section)


def test_the_step_scheduler_gets_the_tenants_weights_live(tenants_app: TestClient, tmp_path: Path) -> None:
    """The fair share (server/step_policy.py Share) reads label -> weight from the registry as it is now."""
    service = tenants_app.app.state.service  # type: ignore[attr-defined]
    weights = service.batcher.share.weights
    assert weights is service.tenants.weights
    assert (weights.get("team-a", 1.0), weights.get("team-b", 1.0), weights.get("x", 1.0)) == (2.0, 1.0, 1.0)
    path, clock = tmp_path / "tenants.json", Clock()
    path.write_text(_file_tenants(("team-a", KEY_A, {})))
    registry = TenantRegistry(AuthSettings(tenants_file=str(path), tenants_reload_s=1.0), clock)
    live = registry.weights
    path.write_text(json.dumps({"tenants": [{"label": "team-a", "digests": [_sha(KEY_A)], "weight": 4.0}]}))
    clock.now += 1
    registry.refresh()
    assert live.get("team-a", 1.0) == 4.0


def test_the_request_context_reaches_the_routes_through_the_whole_stack(tenants_app: TestClient) -> None:
    """What makes a request's later admissions unchecked (server/tenants.py REQUEST) is set by the auth middleware
    and seen by a route behind every other middleware."""
    async def probe(request: Request) -> dict[str, Any]:
        charge = REQUEST.get()
        return {"charge": charge is not None and not charge.admitted, "tenant": tenant_label(request.scope)}

    tenants_app.app.add_api_route("/tenant-probe", probe, methods=["POST"])  # type: ignore[attr-defined]
    answer = tenants_app.post("/tenant-probe", json={}, headers=_bearer(KEY_B))
    assert answer.json() == {"charge": True, "tenant": "team-b"}


def test_a_hires_second_pass_over_the_tenants_size_is_refused_before_the_first_pass(
        tenants_app: TestClient) -> None:
    service = tenants_app.app.state.service  # type: ignore[attr-defined]
    service.quotas.registry.current.by_label["team-b"] = TenantConfig(
        label="team-b", digests=(_sha(KEY_B),), limits=TenantLimits(max_width=96))
    token = REQUEST.set(RequestCharge("team-b"))
    try:
        service.admit_memory([_batch()], (96, 96), False, "hr_scale")  # within the tenant's size
        with pytest.raises(InvalidRequestError, match="width 96, got 128x128") as err:
            service.admit_memory([_batch()], (128, 128), False, "hr_scale")
        assert err.value.param == "hr_scale"
    finally:
        REQUEST.reset(token)
    service.admit_memory([_batch()], (128, 128), False, "hr_scale")  # outside a request: the profile's bounds only
