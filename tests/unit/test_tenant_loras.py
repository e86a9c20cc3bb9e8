"""The LoRA library per tenant (issue 52 point 4): the listing is shared read-only with every tenant; a rescan
(``POST /sdapi/v1/refresh-loras``) is allowed to a tenant whose config says ``lora_refresh = true``, refused with 403
naming the setting otherwise (and then nothing is scanned); without auth everyone may, as before."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
from fastapi.testclient import TestClient

from engines.types.model import LoraInfo
from server.routes.a1111_loras import may_refresh
from server.settings import AuthSettings, load_settings
from server.tenant_config import TenantConfig
from server.tenants import TenantRegistry
from tests.unit.fakes import HashedEngine, start

KEY_ADMIN, KEY_USER, KEY_LOOSE = "sk-lora-admin", "sk-lora-user", "sk-lora-unconfigured"
LIST, REFRESH = "/sdapi/v1/loras", "/sdapi/v1/refresh-loras"
STYLE = LoraInfo("style", "style", "style.safetensors", "0" * 64, 1024, {}, "", {"unet": 4})


def _sha(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def _bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


class CountingEngine(HashedEngine):
    """Counts the library's rescans (a refused refresh must not scan)."""

    def __init__(self) -> None:
        super().__init__()
        self.library = (STYLE,)
        self.scans = 0

    def refresh_loras(self) -> tuple[LoraInfo, ...]:
        self.scans += 1
        return self.library


@pytest.fixture
def counting() -> CountingEngine:
    return CountingEngine()


@pytest.fixture
def two_keys(counting: CountingEngine) -> Iterator[TestClient]:
    auth = AuthSettings(api_key_sha256=(_sha(KEY_LOOSE),),
                        tenants=(TenantConfig(label="admins", digests=(_sha(KEY_ADMIN),), lora_refresh=True),
                                 TenantConfig(label="users", digests=(_sha(KEY_USER),))))
    yield from start(counting, load_settings("dev").model_copy(update={"auth": auth}))


def test_the_listing_is_shared_and_only_a_tenant_with_lora_refresh_rescans(two_keys: TestClient,
                                                                           counting: CountingEngine) -> None:
    for key in (KEY_ADMIN, KEY_USER, KEY_LOOSE):
        listed = two_keys.get(LIST, headers=_bearer(key))
        assert listed.status_code == 200 and [f["name"] for f in listed.json()] == ["style"]
    refused = two_keys.post(REFRESH, headers=_bearer(KEY_USER))
    assert refused.status_code == 403, refused.text
    message = refused.json()["error"]["message"]
    assert "lora_refresh" in message and "'users'" in message and KEY_USER not in refused.text
    loose = two_keys.post(REFRESH, headers=_bearer(KEY_LOOSE))
    assert loose.status_code == 403 and "lora_refresh" in loose.json()["error"]["message"]
    assert counting.scans == 0  # a refused refresh scans nothing
    allowed = two_keys.post(REFRESH, headers=_bearer(KEY_ADMIN))
    assert allowed.status_code == 200 and [f["name"] for f in allowed.json()] == ["style"]
    assert counting.scans == 1
    assert two_keys.post(REFRESH).status_code == 401  # no key at all: auth answers first


def test_without_auth_everyone_refreshes(counting: CountingEngine) -> None:
    for client in start(counting, load_settings("dev")):
        assert client.post(REFRESH).status_code == 200 and counting.scans == 1


def test_keys_without_tenants_refresh_as_before() -> None:
    """Auth with plain keys (no tenant names a key) is one trust domain: every key may rescan."""
    keys_only = TenantRegistry(AuthSettings(api_key_sha256=(_sha(KEY_LOOSE),)))
    assert may_refresh(keys_only, _sha(KEY_LOOSE)[:8]) is None
    assert may_refresh(None, "default") is None
    with_tenants = TenantRegistry(AuthSettings(api_key_sha256=(_sha(KEY_LOOSE),), tenants=(
        TenantConfig(label="users", digests=(_sha(KEY_USER),)),)))
    assert "lora_refresh" in (may_refresh(with_tenants, _sha(KEY_LOOSE)[:8]) or "")
    assert "'users'" in (may_refresh(with_tenants, "users") or "")
