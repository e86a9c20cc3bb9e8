"""The one error hierarchy. The HTTP layer maps each class to a status in a single table (server/errors.py);
the CLI maps boot failures to process exit codes (server/exitcodes.py). Errors that exist only on the HTTP path
(queue full, deadline, client gone) live in server/errors.py, in the same hierarchy."""

from __future__ import annotations


class SdserveError(Exception):
    """Base of every error sdserve raises on purpose."""


class InvalidRequestError(SdserveError):
    """The request cannot be served as asked; ``param`` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class NotReadyError(SdserveError):
    """The engine is not (or no longer) able to serve on its proven path."""

    def __init__(self, message: str, permanent: bool = False) -> None:
        super().__init__(message)
        self.permanent = permanent


class ModelLoadError(SdserveError):
    """A model folder is missing, malformed, or of a kind sdserve does not serve."""


class ConfigError(SdserveError):
    """A profile or config file is invalid; the message says what to change."""


class InferenceError(SdserveError):
    """A session run failed inside the runtime (not the client's fault)."""


class GpuUnavailableError(NotReadyError):
    """The policy's GPU providers cannot run here (library missing, no device, driver too old)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class VersionMismatchError(NotReadyError):
    """Installed versions do not match configs/matrix.toml."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class PlacementError(NotReadyError):
    """A compute op was placed on a provider the policy forbids (CPU fallback)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class ArtifactError(NotReadyError):
    """A model or engine artifact failed verification (exit code 23)."""

    def __init__(self, message: str) -> None:
        super().__init__(message, permanent=True)


class SelfTestError(NotReadyError):
    """Canary output or latency outside its bounds; ``report`` holds the measurements."""

    def __init__(self, message: str, report: object | None = None) -> None:
        super().__init__(message, permanent=False)
        self.report = report
