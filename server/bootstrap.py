"""One place that turns command-line arguments and config files into what boot needs: the profile (with
deployment overrides), the version matrix, the self-test plan and, in dev, the fault injector — one typed object,
``BootConfig``, from which the engine is built."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pydantic import ValidationError

from engines.config import Matrix, SelfTestPlan, Shape, load_canaries, load_matrix, load_slo, parse_size
from engines.errors import ConfigError
from engines.types.health import Faults
from server.settings import CONFIG_DIR, Settings, load_settings

if TYPE_CHECKING:
    from engines.protocol import Engine


def config_path(name: str) -> Path:
    """A config file named in a profile: absolute, or relative to configs/ (SDSERVE_CONFIG_DIR)."""
    path = Path(name)
    return path if path.is_absolute() else CONFIG_DIR / path


def selftest_plan(settings: Settings) -> SelfTestPlan:
    """The self-test plan: canaries x served shapes (sizes x batch sizes; no sizes = the model's native size,
    resolved by the engine after load), the profile's SLO windows."""
    shapes = tuple(Shape(w, h, b) for w, h in map(parse_size, settings.serving.sizes)
                   for b in settings.serving.batch_sizes)
    st = settings.selftest
    return SelfTestPlan(load_canaries(config_path(st.canaries_file)), shapes,
                        load_slo(config_path(st.slo_file), settings.profile), st.timed_runs,
                        st.fingerprint_tolerance, st.cross_platform_tolerance, st.require_fingerprints,
                        batch_sizes=settings.serving.batch_sizes,
                        max_images=max(settings.queue.max_batch, settings.limits.max_n), profile=settings.profile)


def settings_matrix(settings: Settings, override: Path | None = None) -> Matrix:
    """The version matrix: ``override`` (--matrix), else the profile's matrix_file."""
    path = override or Path(settings.matrix_file)
    return load_matrix(path if path.is_absolute() or override else CONFIG_DIR / path)


def with_overrides(settings: Settings, host: str | None = None, port: int | None = None,
                   device_id: int | None = None) -> Settings:
    """The profile with command-line overrides of deployment settings, validated again (bounds apply)."""
    data = settings.model_dump()
    if host is not None:
        data["server"]["host"] = host
    if port is not None:
        data["server"]["port"] = port
    if device_id is not None:
        data["runtime"]["device_id"] = device_id
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"command-line override: {exc.errors()[0]['loc']}: {exc.errors()[0]['msg']}") from None


@dataclass(frozen=True)
class BootConfig:
    """Everything boot reads, resolved once."""

    model: Path
    settings: Settings
    matrix: Matrix
    plan: SelfTestPlan
    faults: Faults | None

    @classmethod
    def create(cls, model: Path, profile: str = "production", config: Path | None = None,
               matrix: Path | None = None, host: str | None = None, port: int | None = None,
               device_id: int | None = None) -> BootConfig:
        settings = with_overrides(load_settings(profile, config), host, port, device_id)
        faults = Faults() if settings.debug.fault_injection else None
        return cls(model, settings, settings_matrix(settings, matrix), selftest_plan(settings), faults)

    def engine(self, watch_ort_log: bool = False) -> Engine:
        """The ONNX Runtime engine for this config (imported here: commands that never build one stay light)."""
        from engines.factory import create_engine

        return create_engine(self.model, self.settings.runtime, self.matrix, self.plan, self.faults,
                             self.settings.signature, watch_ort_log, self.settings.queue.max_running)
