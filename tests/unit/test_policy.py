"""The production provider policy, decided where the policy is made: configs/production.toml through
load_settings, RuntimeSettings and provider_options (the list every session is built with). No session is built
here, so no later check (preflight, ORT's own refusal, the placement audit) can stand in for the policy."""

from __future__ import annotations

from pathlib import Path

import pytest

from engines.config import RuntimeSettings
from engines.errors import ConfigError
from engines.runtime.sessions import provider_options
from server.settings import CONFIG_DIR, load_settings

CPU = "CPUExecutionProvider"
GPU_PROVIDERS = {"TensorrtExecutionProvider", "CUDAExecutionProvider"}
PRODUCTION = CONFIG_DIR / "production.toml"
PROVIDERS_LINE = 'providers = ["TensorrtExecutionProvider", "CUDAExecutionProvider"]'


def test_production_sessions_are_built_with_gpu_providers_only() -> None:
    runtime = load_settings("production").runtime
    names = [name for name, _ in provider_options(runtime, Path("/models/m"), total_memory=80 << 30)]
    assert names, "production lists no provider"
    assert CPU not in names and set(names) <= GPU_PROVIDERS
    assert runtime.allow_cpu is False and runtime.device == "cuda"


def test_production_default_profile_is_the_one_checked() -> None:
    """`sdserve serve` without --profile loads production (the CLI default and load_settings' default agree)."""
    assert load_settings().profile == "production" and load_settings().runtime == load_settings("production").runtime


@pytest.mark.parametrize("providers", [
    '["TensorrtExecutionProvider", "CUDAExecutionProvider", "CPUExecutionProvider"]',
    '["CPUExecutionProvider"]',
])
@pytest.mark.parametrize("allow_cpu", ["", "allow_cpu = true\n"])
def test_a_production_profile_listing_the_cpu_is_refused_at_load(tmp_path: Path, providers: str,
                                                                 allow_cpu: str) -> None:
    text = PRODUCTION.read_text()
    assert PROVIDERS_LINE in text, "configs/production.toml changed: update PROVIDERS_LINE"
    text = text.replace(PROVIDERS_LINE, f"providers = {providers}")
    if allow_cpu:
        text = text.replace("allow_cpu = false\n", allow_cpu)
    profile = tmp_path / "production.toml"
    profile.write_text(text)
    with pytest.raises(ConfigError, match="CPUExecutionProvider|allow_cpu"):
        load_settings("production", profile)


def test_runtime_policy_refuses_the_cpu_unless_explicitly_allowed() -> None:
    with pytest.raises(ValueError, match="allow_cpu is false"):
        RuntimeSettings(providers=("CUDAExecutionProvider", CPU))
    with pytest.raises(ValueError, match="must come last"):
        RuntimeSettings(providers=(CPU, "CUDAExecutionProvider"), allow_cpu=True)
    assert RuntimeSettings().providers == ("TensorrtExecutionProvider", "CUDAExecutionProvider")


def test_environment_cannot_put_the_cpu_into_production(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only deployment settings have environment overrides; nothing there reaches the provider list."""
    for key, value in {"SDSERVE_PROVIDERS": CPU, "SDSERVE_RUNTIME_PROVIDERS": CPU, "SDSERVE_ALLOW_CPU": "true",
                       "SDSERVE_RUNTIME_ALLOW_CPU": "true", "SDSERVE_DEVICE_ID": "1"}.items():
        monkeypatch.setenv(key, value)
    runtime = load_settings("production").runtime
    assert runtime.device_id == 1  # the environment was read
    assert CPU not in [name for name, _ in provider_options(runtime)] and not runtime.allow_cpu


TRT, CUDA = "TensorrtExecutionProvider", "CUDAExecutionProvider"
PROVIDER_FAILED = ("[W:onnxruntime:Default, onnxruntime_pybind_state.cc:1014 CreateExecutionProviderFactoryInstance] "
                   "Failed to create TensorrtExecutionProvider. Please reference https://onnxruntime.ai/docs/")


@pytest.mark.parametrize(("used", "lines"), [
    ([CUDA, CPU], []),  # TensorRT failed to create (a warning in ORT) and the session went on with CUDA
    ([TRT, CUDA, CPU], [PROVIDER_FAILED]),  # every provider listed, but a creation failure was logged
    ([CPU], []),
])
def test_production_refuses_a_session_missing_any_policy_provider(used: list[str], lines: list[str]) -> None:
    """The whole policy, not its first entry: what ORT reports in use must include every provider asked for."""
    from engines.errors import GpuUnavailableError
    from engines.runtime.ortlog import classify
    from engines.runtime.sessions import SessionReport, enforce

    runtime = load_settings("production").runtime
    report = SessionReport("unet", list(runtime.providers), used, classify(lines))
    with pytest.raises(GpuUnavailableError, match="policy requires"):
        enforce(report, runtime)
    enforce(report, load_settings("dev").runtime)  # the dev policy accepts it: the refusal is production's
