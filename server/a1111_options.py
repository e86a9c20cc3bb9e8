"""The AUTOMATIC1111 options sdserve answers at /sdapi/v1/options, and the writes it can honour.

Keys, types and A1111's defaults come from AUTOMATIC1111/stable-diffusion-webui ``modules/shared_options.py``
(``sd_model_checkpoint``, ``sd_checkpoint_hash`` (hidden options), ``samples_format``, ``samples_save``,
``CLIP_stop_at_last_layers``, ``sd_vae``, ``send_seed``, ``send_size``, ``live_previews_enable``). A1111's
``Api.set_config`` (``modules/api/api.py``) writes any key and saves it to disk; sdserve instead:

* answers only the keys below, each with what sdserve really does (``samples_save`` is false: sdserve never writes
  images to disk; ``live_previews_enable`` is false: the engine reports no intermediate images);
* accepts a write that equals what sdserve does (so a client may post back the whole GET body, as Open WebUI's
  ``set_image_model`` does) and a write to a key it can honour (``send_seed``, ``send_size``: kept for the life of
  the process, never on disk, per tenant: one tenant's write never changes what another reads, issue 52 point 4;
  no write changes a generation's result, so no tenant's write reaches another's images);
* refuses everything else with 422 naming the key: an unknown key, a value sdserve cannot honour, a checkpoint that is
  not the served model (the message names the served one). A refused write changes nothing (all keys are checked
  before any is stored).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from engines.errors import InvalidRequestError
from engines.types.model import ModelInfo


def model_title(info: ModelInfo) -> str:
    """The served model's A1111 title, ``name [shorthash]``: what /sdapi/v1/sd-models lists and clients send back."""
    short = info.digest[:10]
    return f"{info.name} [{short}]" if short else info.name


def checkpoint_names(info: ModelInfo) -> frozenset[str]:
    """The names a client may use for the served model (A1111 accepts the title, the name and the hashes too)."""
    names = {model_title(info), info.name}
    if info.digest:
        names |= {info.digest, info.digest[:10]}
    return frozenset(names)


def refuse_other_checkpoint(value: object, info: ModelInfo, param: str) -> None:
    """422 unless ``value`` names the served model; the message names the served one (one model per process)."""
    if not isinstance(value, str) or value not in checkpoint_names(info):
        raise InvalidRequestError(f"{param}: {value!r} is not served here; this server serves only "
                                  f"{model_title(info)!r} (one model per process)", param=param)


@dataclass(frozen=True)
class Fixed:
    """A setting sdserve cannot change: a write is accepted only when it equals what sdserve does."""

    value: Callable[[ModelInfo], object]
    accepts: Callable[[object, ModelInfo], bool]
    why: str


def _const(value: object) -> Callable[[ModelInfo], object]:
    return lambda info: value


def _is(*allowed: object) -> Callable[[object, ModelInfo], bool]:
    return lambda value, info: type(value) is not bool and value in allowed


FIXED: dict[str, Fixed] = {
    "sd_checkpoint_hash": Fixed(lambda info: info.digest, lambda v, info: v == info.digest,
                                "read-only: the sha256 of the served model"),
    "samples_format": Fixed(_const("png"), lambda v, info: isinstance(v, str) and v.lower() == "png",
                            "sdserve returns PNG images only"),
    "samples_save": Fixed(_const(False), lambda v, info: v is False, "sdserve never writes images to disk"),
    "CLIP_stop_at_last_layers": Fixed(_const(1), _is(1),
                                      "the served text encoder outputs its last layer only (clip skip 1)"),
    "sd_vae": Fixed(_const("Automatic"), _is("Automatic", "None"),
                    "the served model's own VAE is the only one (Automatic or None, as A1111 names it)"),
    "live_previews_enable": Fixed(_const(False), lambda v, info: v is False,
                                  "no live previews: the engine reports no intermediate images"),
}
WRITABLE: dict[str, bool] = {"send_seed": True, "send_size": True}
"""Boolean settings sdserve keeps for the process (A1111 defaults); they are interface hints, stored and echoed."""


MAX_PROBLEMS = 5
"""Refused keys named in one 422 (the count says how many more)."""
SUPPORTED = sorted(["sd_model_checkpoint", *FIXED, *WRITABLE])


def _short(value: object, limit: int = 64) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


def empty_overrides(overrides: Mapping[str, object]) -> list[str]:
    """The per-request overrides that say nothing (``""`` or null): A1111's process_images drops a checkpoint
    override it cannot resolve and applies an empty value as no change, and clients send them for a setting left
    blank (Dify's tool: ``sd_model_checkpoint: ""`` when no model is picked). They are named as ignored."""
    return [key for key, value in overrides.items() if value is None or value == ""]


def set_overrides(overrides: Mapping[str, object]) -> dict[str, object]:
    """The per-request overrides that say something: what ``OptionsStore.check`` judges."""
    return {key: value for key, value in overrides.items() if not (value is None or value == "")}


DEFAULT_TENANT = "default"
"""The one tenant without auth (server/middleware.py tenant_label)."""


class OptionsStore:
    """The process's A1111 options: the fixed ones derived from the served model, the writable ones in memory, one
    set per tenant (a tenant that never wrote reads A1111's defaults)."""

    def __init__(self) -> None:
        self._values: dict[str, dict[str, bool]] = {}

    def values(self, tenant: str = DEFAULT_TENANT) -> dict[str, bool]:
        """``tenant``'s writable options (a copy)."""
        return dict(self._values.get(tenant, WRITABLE))

    def snapshot(self, info: ModelInfo, tenant: str = DEFAULT_TENANT) -> dict[str, Any]:
        """The GET /sdapi/v1/options body ``tenant`` reads."""
        body: dict[str, Any] = {"sd_model_checkpoint": model_title(info)}
        body |= {key: fixed.value(info) for key, fixed in FIXED.items()}
        return body | self.values(tenant)

    def problems(self, body: Mapping[str, object], info: ModelInfo, prefix: str = "",
                 keep: int = MAX_PROBLEMS) -> tuple[list[tuple[str, str]], int]:
        """(param, message) for the first ``keep`` keys of ``body`` sdserve cannot honour, and how many there are
        in all (both 0/empty when every key can be honoured)."""
        found: list[tuple[str, str]] = []
        count = 0
        for key, value in body.items():
            problem = self._problem(prefix + key, key, value, info)
            if problem is not None:
                count += 1
                if len(found) < keep:
                    found.append((prefix + key, problem))
        return found, count

    def _problem(self, param: str, key: str, value: object, info: ModelInfo) -> str | None:
        shown = _short(value)
        if key == "sd_model_checkpoint":
            try:
                refuse_other_checkpoint(value, info, param)
            except InvalidRequestError as exc:
                return exc.message
        elif key in FIXED:
            fixed = FIXED[key]
            if not fixed.accepts(value, info):
                return f"{_short(param)}: cannot be set to {shown} (it is {fixed.value(info)!r}): {fixed.why}"
        elif key in WRITABLE:
            if not isinstance(value, bool):
                return f"{_short(param)}: must be true or false, got {shown}"
        else:
            return f"{_short(param)}: unknown or unsupported option"
        return None

    def check(self, body: Mapping[str, object], info: ModelInfo, prefix: str = "") -> None:
        """Raise one 422 naming the first refused key; its message lists the first few refused keys, how many
        there are in all and the supported options once (O(1) in size, however many keys the body holds).

        ``prefix`` names where the keys came from: "" for POST /options, "override_settings." for a generation
        request's per-request overrides (which are checked, never stored)."""
        found, count = self.problems(body, info, prefix)
        if found:
            more = f"; {count} refused key(s) in all" if count > len(found) else ""
            unknown = any(m.endswith("unknown or unsupported option") for _, m in found)
            supported = f"; sdserve supports {SUPPORTED}" if unknown else ""
            raise InvalidRequestError("; ".join(m for _, m in found) + more + supported, param=found[0][0][:200])

    def apply(self, body: Mapping[str, object], info: ModelInfo, tenant: str = DEFAULT_TENANT) -> None:
        """POST /sdapi/v1/options for ``tenant``: all keys are checked before any is stored, so a refused write
        changes nothing; a write changes only ``tenant``'s options."""
        self.check(body, info)
        values = self.values(tenant)
        for key in WRITABLE.keys() & body.keys():
            value = body[key]
            assert isinstance(value, bool)  # checked above
            values[key] = value
        self._values[tenant] = values
