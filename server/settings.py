"""Profiles: typed, bounded, documented, frozen settings loaded from configs/<profile>.toml.

Environment overrides exist only for deployment settings (host, port, model folder, device id), all with the
``SDSERVE_`` prefix; nothing in the environment can allow the CPU or loosen a check.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engines.config import RuntimeSettings
from engines.errors import ConfigError
from engines.matrix import Matrix, load_matrix
from engines.schedulers import SCHEDULERS
from engines.signature import SignatureThresholds

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
ENV_PREFIX = "SDSERVE_"


class ServerSettings(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = "127.0.0.1"
    """Interface to bind."""
    port: int = Field(8000, ge=0, le=65535)
    """TCP port; 0 picks a free one and logs it."""


class Limits(BaseModel):
    """Upper bounds a request may ask for; the model's own constraints apply on top."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_n: int = Field(4, ge=1, le=16)
    """Images per request."""
    max_steps: int = Field(50, ge=1, le=200)
    """Denoising steps per request."""
    max_width: int = Field(1024, ge=16, le=4096)
    max_height: int = Field(1024, ge=16, le=4096)
    max_prompt_chars: int = Field(4000, ge=1, le=100_000)
    """Characters per prompt (the tokenizer keeps 77 tokens; this bounds the work of tokenizing)."""


class Defaults(BaseModel):
    """Values used when a request leaves a field out."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(20, ge=1, le=200)
    guidance_scale: float = Field(7.5, ge=0.0, le=30.0)
    scheduler: str = "euler"

    @model_validator(mode="after")
    def _known_scheduler(self) -> Defaults:
        if self.scheduler not in SCHEDULERS:
            raise ValueError(f"defaults.scheduler {self.scheduler!r} is not one of {sorted(SCHEDULERS)}")
        return self


class Settings(BaseModel):
    """One profile."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    profile: Literal["dev", "production"] = "production"
    on_boot_failure: Literal["exit", "stay_unready"] = "exit"
    """exit: a failed boot check ends the process with its exit code; stay_unready: keep serving /ready 503."""
    matrix_file: str = "matrix.toml"
    """Version matrix, relative to configs/ unless absolute."""
    runtime: RuntimeSettings = RuntimeSettings()
    signature: SignatureThresholds = SignatureThresholds()
    server: ServerSettings = ServerSettings()
    limits: Limits = Limits()
    defaults: Defaults = Defaults()

    @model_validator(mode="after")
    def _cross(self) -> Settings:
        if self.profile == "production" and self.runtime.allow_cpu:
            raise ValueError("production profile with runtime.allow_cpu = true: production never runs on the CPU; "
                             "use the dev profile")
        if self.defaults.steps > self.limits.max_steps:
            raise ValueError(f"defaults.steps {self.defaults.steps} exceeds limits.max_steps {self.limits.max_steps}")
        return self


def _env_overrides(data: dict[str, object]) -> dict[str, object]:
    server = dict(data.get("server", {}))  # type: ignore[call-overload]
    runtime = dict(data.get("runtime", {}))  # type: ignore[call-overload]
    if f"{ENV_PREFIX}HOST" in os.environ:
        server["host"] = os.environ[f"{ENV_PREFIX}HOST"]
    if f"{ENV_PREFIX}PORT" in os.environ:
        server["port"] = os.environ[f"{ENV_PREFIX}PORT"]
    if f"{ENV_PREFIX}DEVICE_ID" in os.environ:
        runtime["device_id"] = os.environ[f"{ENV_PREFIX}DEVICE_ID"]
    return {**data, "server": server, "runtime": runtime}


def load_settings(profile: str = "production", config: Path | None = None) -> Settings:
    """Load ``config`` or ``configs/<profile>.toml``; raises ConfigError naming the file and the field."""
    path = config or CONFIG_DIR / f"{profile}.toml"
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"profile file {path} not found (profiles: dev, production)") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: invalid TOML: {exc}") from None
    if config is None and data.get("profile", profile) != profile:
        raise ConfigError(f"{path} declares profile {data.get('profile')!r}, expected {profile!r}")
    try:
        return Settings.model_validate(_env_overrides(data))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"{path}: {problems}") from None


def settings_matrix(settings: Settings, override: Path | None = None) -> Matrix:
    path = override or Path(settings.matrix_file)
    return load_matrix(path if path.is_absolute() or override else CONFIG_DIR / path)
