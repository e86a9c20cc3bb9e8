"""Profiles: typed, bounded, and nothing turns production into CPU mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.errors import ConfigError
from server.settings import load_settings


def test_profiles_load_and_differ_where_they_must() -> None:
    dev, prod = load_settings("dev"), load_settings("production")
    assert dev.runtime.allow_cpu and dev.runtime.providers == ("CPUExecutionProvider",)
    assert not prod.runtime.allow_cpu
    assert prod.runtime.providers == ("TensorrtExecutionProvider", "CUDAExecutionProvider")
    assert prod.on_boot_failure == "exit" and dev.on_boot_failure == "stay_unready"


@pytest.mark.parametrize(("toml", "fragment"), [
    ('profile = "production"\n[runtime]\nallow_cpu = true\nproviders = ["CPUExecutionProvider"]\n',
     "production never runs on the CPU"),
    ('profile = "dev"\n[runtime]\nproviders = ["CPUExecutionProvider"]\n', "allow_cpu is false"),
    ('profile = "dev"\n[limits]\nmax_n = 99\n', "limits.max_n"),
    ('profile = "dev"\n[defaults]\nscheduler = "pndm"\n', "defaults.scheduler"),
    ('profile = "dev"\n[server]\nprot = 1\n', "server.prot"),
    ('profile = "dev"\n[runtime]\nproviders = []\n', "providers is empty"),
    ("profile = [", "invalid TOML"),
])
def test_invalid_profiles_say_what_to_change(tmp_path: Path, toml: str, fragment: str) -> None:
    path = tmp_path / "p.toml"
    path.write_text(toml)
    with pytest.raises(ConfigError, match=fragment.replace("[", r"\[")):
        load_settings("dev", path)


def test_env_overrides_only_deployment_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDSERVE_PORT", "9123")
    monkeypatch.setenv("SDSERVE_DEVICE_ID", "3")
    monkeypatch.setenv("SDSERVE_ALLOW_CPU", "true")  # not a thing: must change nothing
    settings = load_settings("production")
    assert settings.server.port == 9123 and settings.runtime.device_id == 3
    assert not settings.runtime.allow_cpu


def test_settings_are_frozen() -> None:
    settings = load_settings("dev")
    with pytest.raises(ValueError, match="frozen"):
        settings.runtime.allow_cpu = False  # type: ignore[misc]


def test_the_library_folders_come_from_the_environment_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """SDSERVE_LORA_DIR and SDSERVE_CONTROLNET_DIR set [runtime.lora] dir and [runtime.controlnet] dir, as the
    serve flags --lora-dir and --controlnet-dir do (a container sets them without a profile of its own)."""
    monkeypatch.setenv("SDSERVE_LORA_DIR", "/models/loras")
    monkeypatch.setenv("SDSERVE_CONTROLNET_DIR", "/models/controlnet")
    runtime = load_settings("dev").runtime
    assert (runtime.lora.dir, runtime.controlnet.dir) == ("/models/loras", "/models/controlnet")
