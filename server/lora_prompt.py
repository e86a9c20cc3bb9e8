"""A request's adapter set: ``<lora:name:mult>`` tags parsed out of the prompt as A1111 does, and the OpenAI routes'
``loras`` extension field, resolved against the engine's library into one sorted set (engines.types.request.LoraUse).

A1111's syntax (extensions-builtin/Lora/extra_networks_lora.py and modules/extra_networks.py): a tag is
``<lora:NAME>``, ``<lora:NAME:TE>`` or ``<lora:NAME:TE:UNET>`` with named ``te=`` / ``unet=`` overriding the
positions; the denoiser multiplier defaults to the text encoders', which defaults to 1.0. Tags are removed from the
text the encoder sees, nothing else (A1111 removes every ``<kind:...>`` extra-network tag the same way); ``lyco``
is A1111's alias of ``lora``.
A hypernetwork tag is refused (sdserve has none), never silently dropped. Unknown names, refused files and bad
multipliers are 400 (OpenAI) / 422 (A1111) naming the field, before admission.

The tags are found by a single left-to-right scan (``find_tags``), linear in the prompt's length: A1111's pattern
``<(\w+):([^>]+)>`` run by ``re`` backtracks quadratically on a long prompt of ``<x:`` without ``>`` (25 s at
100,000 characters), and this runs before admission. A name is the file's name or, as A1111 resolves it, its alias
(the file's ``ss_output_name``): the file name wins when both match, and an alias two files share is refused
naming them.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

from engines.errors import InvalidRequestError
from engines.types.model import LoraInfo
from engines.types.request import LoraUse
from server import headers

KIND = re.compile(r"\w+")
"""A tag's kind: A1111's re_extra_net is ``<(\w+):([^>]+)>``."""
LORA_KINDS = ("lora", "lyco")
MAX_TAGS = 64
"""LoRA tags one prompt may hold (the most [runtime.lora] max_per_request allows): parsing stops there."""


@dataclass(frozen=True)
class Wanted:
    """One LoRA as the request asked for it, before the library is consulted."""

    name: str
    te: float
    unet: float
    field: str
    """The request field that named it: ``prompt`` (a tag) or ``loras.<i>``."""


def find_tags(prompt: str) -> Iterator[tuple[int, int, str, str]]:
    """(start, end, kind, body) of every ``<kind:body>`` tag, as ``re.finditer`` with A1111's pattern finds them,
    in one pass: each ``>`` search resumes where the last one stopped, so no character is scanned twice."""
    close = -1
    at = prompt.find("<")
    while at >= 0:
        kind = KIND.match(prompt, at + 1)
        colon = kind.end() if kind is not None else -1
        if colon >= 0 and prompt.startswith(":", colon):
            if close <= colon:
                close = prompt.find(">", colon + 1)
                if close < 0:
                    return  # no ">" after here: no tag can end
            if close > colon + 1:  # a non-empty body
                yield at, close + 1, prompt[at + 1:colon], prompt[colon + 1:close]
                at = prompt.find("<", close + 1)
                continue
        at = prompt.find("<", at + 1)


def parse_prompt(prompt: str) -> tuple[str, list[Wanted]]:
    """(prompt without LoRA tags, the tags' LoRAs). InvalidRequestError names ``prompt`` for a malformed tag."""
    wanted: list[Wanted] = []
    kept: list[str] = []
    last = 0
    for start, end, kind, body in find_tags(prompt):
        text = prompt[start:end]
        if kind == "hypernet":
            raise InvalidRequestError(f"prompt: {text[:200]!r} asks for a hypernetwork; this server serves "
                                      "LoRAs only (<lora:name:multiplier>)", param="prompt")
        if kind not in LORA_KINDS:
            continue
        if len(wanted) == MAX_TAGS:
            raise InvalidRequestError(f"prompt: more than {MAX_TAGS} LoRA tags; a request takes at most "
                                      f"{MAX_TAGS} ([runtime.lora] max_per_request may be lower)", param="prompt")
        wanted.append(_tag(text[:300], body))
        kept.append(prompt[last:start])  # as A1111: the tag's text goes, the commas around it stay
        last = end
    if not wanted:
        return prompt, wanted
    kept.append(prompt[last:])
    return "".join(kept).strip(), wanted


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
        found = lookup(w.name, w.field, library)
        if found.problem:
            raise InvalidRequestError(f"{w.field}: LoRA {w.name!r} is refused: {found.problem}", param=w.field)
        uses.append(LoraUse(found.name, found.sha256, w.te, w.unet))
    return tuple(sorted(_once_each(uses, items, max_multiplier), key=lambda u: (u.sha256, u.te, u.unet)))


def _once_each(uses: list[LoraUse], items: list[Wanted], max_multiplier: float) -> list[LoraUse]:
    """One use per file: a file named more than once (two tags, or a tag and an alias) is applied once with the
    sum of its multipliers, which is what adding its delta once per tag comes to; the sum is held to the same
    bound as one multiplier (eight tags at 10 would otherwise be an 80x delta)."""
    merged: dict[str, LoraUse] = {}
    for use, w in zip(uses, items, strict=True):
        seen = merged.get(use.sha256)
        if seen is None:
            merged[use.sha256] = use
            continue
        te, unet = seen.te + use.te, seen.unet + use.unet
        if max(abs(te), abs(unet)) > max_multiplier:
            raise InvalidRequestError(f"{w.field}: LoRA {w.name!r} is named more than once and its multipliers "
                                      f"add up to {max(te, unet, key=abs):g}, outside [-{max_multiplier:g}, "
                                      f"{max_multiplier:g}] ([runtime.lora] max_multiplier)", param=w.field)
        merged[use.sha256] = LoraUse(seen.name, seen.sha256, te, unet)
    return list(merged.values())


def by_name(files: Iterable[LoraInfo]) -> dict[str, LoraInfo]:
    """The library by file name, as its scan decided: of two files with one name the first (listed usable) wins;
    the second, listed refused ("another file has the same name"), never hides it."""
    found: dict[str, LoraInfo] = {}
    for file in files:
        found.setdefault(file.name, file)
    return found


def lookup(name: str, field: str, library: Mapping[str, LoraInfo]) -> LoraInfo:
    """The library's file for ``name`` (NFC, as the library normalizes file names): by file name first, else by
    alias among usable files, as A1111 resolves them; InvalidRequestError naming ``field`` for an unknown name or
    an alias two usable files share."""
    name = unicodedata.normalize("NFC", name)
    found = library.get(name)
    if found is not None:
        return found
    aliased = sorted((f for f in library.values() if f.alias == name and not f.problem), key=lambda f: f.path)
    if len(aliased) == 1:
        return aliased[0]
    if aliased:
        files = ", ".join(f"{f.name} ({f.path})" for f in aliased[:5])
        raise InvalidRequestError(f"{field}: LoRA alias {name[:128]!r} is ambiguous: the files {files} all have it "
                                  "(ss_output_name); name one by its file name", param=field)
    known = ", ".join(sorted(n for n, f in library.items() if not f.problem)[:20]) or "none usable"
    raise InvalidRequestError(f"{field}: unknown LoRA {name[:128]!r}; this server has: {known} (GET "
                              "/sdapi/v1/loras)", param=field)


def header_value(uses: tuple[LoraUse, ...]) -> str:
    """``x-sdserve-loras``: ``name:sha256[:12]:te:unet`` per LoRA (the name percent-encoded: headers.token),
    comma-separated; ``none`` without LoRA."""
    return ",".join(f"{headers.token(u.name)}:{u.sha256[:12]}:{u.te:g}:{u.unet:g}" for u in uses) or "none"
