"""A request's adapter set: ``<lora:name:mult>`` tags parsed out of the prompt as A1111 does, and the OpenAI routes'
``loras`` extension field, resolved against the engine's library into one sorted set (engines.protocol.LoraUse).

A1111's syntax (extensions-builtin/Lora/extra_networks_lora.py and modules/extra_networks.py): a tag is
``<lora:NAME>``, ``<lora:NAME:TE>`` or ``<lora:NAME:TE:UNET>`` with named ``te=`` / ``unet=`` overriding the
positions; the denoiser multiplier defaults to the text encoders', which defaults to 1.0. Tags are removed from the
text the encoder sees, nothing else (A1111 removes every ``<kind:...>`` extra-network tag the same way); ``lyco``
is A1111's alias of ``lora``.
A hypernetwork tag is refused (sdserve has none), never silently dropped. Unknown names, refused files and bad
multipliers are 400 (OpenAI) / 422 (A1111) naming the field, before admission.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from engines.errors import InvalidRequestError
from engines.protocol import LoraInfo, LoraUse

TAG = re.compile(r"<(\w+):([^>]+)>")
"""A1111's re_extra_net."""
LORA_KINDS = ("lora", "lyco")


@dataclass(frozen=True)
class Wanted:
    """One LoRA as the request asked for it, before the library is consulted."""

    name: str
    te: float
    unet: float
    field: str
    """The request field that named it: ``prompt`` (a tag) or ``loras.<i>``."""


def parse_prompt(prompt: str) -> tuple[str, list[Wanted]]:
    """(prompt without LoRA tags, the tags' LoRAs). InvalidRequestError names ``prompt`` for a malformed tag."""
    wanted: list[Wanted] = []

    def take(match: re.Match[str]) -> str:
        kind, body = match.group(1), match.group(2)
        if kind == "hypernet":
            raise InvalidRequestError(f"prompt: {match.group(0)!r} asks for a hypernetwork; this server serves "
                                      "LoRAs only (<lora:name:multiplier>)", param="prompt")
        if kind not in LORA_KINDS:
            return match.group(0)
        wanted.append(_tag(match.group(0), body))
        return ""

    stripped = TAG.sub(take, prompt)  # as A1111: the tag's text goes, the commas around it stay
    return (stripped.strip() if wanted else prompt), wanted


def _tag(text: str, body: str) -> Wanted:
    items = body.split(":")
    positional = [i for i in items if "=" not in i]
    named = dict(i.split("=", 1) for i in items if "=" in i)
    unknown = sorted(set(named) - {"te", "unet"})
    if unknown:
        raise InvalidRequestError(f"prompt: {text!r} has {', '.join(unknown)}=, which this server does not take "
                                  "(te= and unet= are the multipliers)", param="prompt")
    if not positional or not positional[0].strip():
        raise InvalidRequestError(f"prompt: {text!r} names no LoRA", param="prompt")
    te = _number(named.get("te", positional[1] if len(positional) > 1 else "1"), text)
    unet = _number(named.get("unet", positional[2] if len(positional) > 2 else str(te)), text)
    if len(positional) > 3:
        raise InvalidRequestError(f"prompt: {text!r} has more than name:te:unet", param="prompt")
    return Wanted(positional[0].strip(), te, unet, "prompt")


def _number(value: str, text: str) -> float:
    try:
        number = float(value)
    except ValueError:
        raise InvalidRequestError(f"prompt: {text!r}: {value!r} is not a multiplier", param="prompt") from None
    return number


def resolve(wanted: Iterable[Wanted], library: Mapping[str, LoraInfo], max_count: int,
            max_multiplier: float) -> tuple[LoraUse, ...]:
    """The set, checked against the library and the profile's bounds, sorted by its key."""
    items = list(wanted)
    if not items:
        return ()
    if not library:
        raise InvalidRequestError(f"{items[0].field}: LoRA {items[0].name!r} asked for, but this server has no "
                                  "LoRA library ([runtime.lora] dir, --lora-dir)", param=items[0].field)
    if len(items) > max_count:
        raise InvalidRequestError(f"{len(items)} LoRAs asked for; this server takes at most {max_count} per request "
                                  "([runtime.lora] max_per_request)", param=items[max_count].field)
    uses = []
    for w in items:
        for value in (w.te, w.unet):
            if not math.isfinite(value) or abs(value) > max_multiplier:
                raise InvalidRequestError(f"{w.field}: LoRA {w.name!r} multiplier {value} is outside "
                                          f"[-{max_multiplier:g}, {max_multiplier:g}] ([runtime.lora] "
                                          "max_multiplier)", param=w.field)
        found = library.get(w.name)
        if found is None:
            known = ", ".join(sorted(n for n, f in library.items() if not f.problem)[:20]) or "none usable"
            raise InvalidRequestError(f"{w.field}: unknown LoRA {w.name[:128]!r}; this server has: {known} (GET "
                                      "/sdapi/v1/loras)", param=w.field)
        if found.problem:
            raise InvalidRequestError(f"{w.field}: LoRA {w.name!r} is refused: {found.problem}", param=w.field)
        uses.append(LoraUse(found.name, found.sha256, w.te, w.unet))
    return tuple(sorted(uses, key=lambda u: (u.sha256, u.te, u.unet)))


def header_value(uses: tuple[LoraUse, ...]) -> str:
    """``x-sdserve-loras``: ``name:sha256[:12]:te:unet`` per LoRA, comma-separated; ``none`` without LoRA."""
    return ",".join(f"{u.name}:{u.sha256[:12]}:{u.te:g}:{u.unet:g}" for u in uses) or "none"
