"""Process exit codes: one table (docs/reference/exit-codes.md, generated; docs/gpu-path.md). Orchestrators
reschedule on non-zero."""

from __future__ import annotations

from enum import IntEnum

from engines.errors import (
    ArtifactError,
    ConfigError,
    GpuUnavailableError,
    InvalidRequestError,
    ModelLoadError,
    PlacementError,
    SelfTestError,
    VersionMismatchError,
)
from server.errors import BindError
from server.provenance import CredentialError


class ExitCode(IntEnum):
    OK = 0
    INTERNAL = 1
    USAGE = 2
    CONFIG_INVALID = 10
    MODEL_INVALID = 11
    CANNOT_BIND = 12
    PROVENANCE_KEY_INVALID = 13
    """[provenance] mode require without a usable signing key and certificate chain."""
    GPU_UNAVAILABLE = 20
    VERSION_MISMATCH = 21
    PLACEMENT_FAILED = 22
    ARTIFACT_INVALID = 23
    SELF_TEST_FAILED = 24
    GATE_REGRESSION = 30
    VERIFY_UNTRUSTED = 40
    """`sdserve verify`: the manifest is intact but its signer is not in the trust list (or none was given)."""
    VERIFY_INVALID = 41
    """`sdserve verify`: the manifest does not validate (pixels or manifest changed after signing)."""
    VERIFY_NO_MANIFEST = 42
    """`sdserve verify`: no C2PA manifest (never signed, or stripped)."""
    VERIFY_WATERMARK_ONLY = 43
    """`sdserve verify`: no C2PA manifest, but an sdserve watermark: the image came from an sdserve server and its
    manifest was stripped (re-encoded, metadata removed); the payload names the request in that server's log."""


_TABLE: tuple[tuple[type[BaseException], ExitCode], ...] = (
    (InvalidRequestError, ExitCode.USAGE),
    (CredentialError, ExitCode.PROVENANCE_KEY_INVALID),
    (ConfigError, ExitCode.CONFIG_INVALID),
    (ModelLoadError, ExitCode.MODEL_INVALID),
    (GpuUnavailableError, ExitCode.GPU_UNAVAILABLE),
    (VersionMismatchError, ExitCode.VERSION_MISMATCH),
    (PlacementError, ExitCode.PLACEMENT_FAILED),
    (SelfTestError, ExitCode.SELF_TEST_FAILED),
    (ArtifactError, ExitCode.ARTIFACT_INVALID),
    (BindError, ExitCode.CANNOT_BIND),
)


def exit_code_for(exc: BaseException) -> ExitCode:
    for cls, code in _TABLE:
        if isinstance(exc, cls):
            return code
    return ExitCode.INTERNAL
