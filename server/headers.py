"""Every HTTP header sdserve reads or writes, named once. The CORS policy exposes exactly RESPONSE (server/app.py):
a header a response carries but a browser cannot read is a header that does not exist for a web client.

Values built from client input go through ``put`` (``value``), names inside them through ``token``: a value h11
refuses is only found after the work is done, and then the client gets no response at all (an A1111 field ``"x "``,
a LoRA named in CJK or with a CR: issue 43). The guard middleware repairs any other invalid value the same way
(``repaired``) before uvicorn sees it, so no builder can emit one."""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote

from starlette.datastructures import MutableHeaders

REQUEST_ID = "x-request-id"
"""Both ways: a caller's id is echoed, else one is made."""
TIMEOUT = "x-sdserve-timeout-s"
"""Request: the caller's deadline in seconds."""

MODEL = "x-sdserve-model"
PROVIDER = "x-sdserve-provider"
"""The execution provider of the session that ran the denoiser (the LoRA variant's when a LoRA applied)."""
SEEDS = "x-sdserve-seeds"
BATCH_SIZE = "x-sdserve-batch-size"
WARNINGS = "x-sdserve-warnings"
IGNORED_FIELDS = "x-sdserve-ignored-fields"
INTERRUPTED = "x-sdserve-interrupted"
INTERRUPT = "x-sdserve-interrupt"
RESIDENT = "x-sdserve-resident"
MODE = "x-sdserve-mode"
STRENGTH = "x-sdserve-strength"
LORAS = "x-sdserve-loras"
PROVENANCE = "x-sdserve-provenance"
WATERMARK = "x-sdserve-watermark"
CACHE = "x-sdserve-cache"
"""The step cache that ran (method:threshold; reused=evaluations reused/evaluations); absent: none ran."""
SERVER_TIMING = "server-timing"
RETRY_AFTER = "retry-after"
SHOULD_RETRY = "x-should-retry"

RESPONSE = (REQUEST_ID, MODEL, PROVIDER, SEEDS, BATCH_SIZE, WARNINGS, IGNORED_FIELDS, INTERRUPTED, INTERRUPT,
            RESIDENT, MODE, STRENGTH, LORAS, PROVENANCE, WATERMARK, CACHE, SERVER_TIMING, RETRY_AFTER,
            SHOULD_RETRY)
"""Every header a response may carry: what CORS exposes."""
REQUEST = (REQUEST_ID, TIMEOUT, "authorization", "content-type")
"""The headers a browser may send (CORS allow_headers)."""

MAX_VALUE_CHARS = 2000
"""Characters of one value at most (Node's http client refuses a response whose headers pass 16 KiB in all)."""
_VALID = re.compile(r"[!-~]+(?:[ \t]+[!-~]+)*")
_VALID_RAW = re.compile(rb"(?:[!-~]+(?:[ \t]+[!-~]+)*)?")


def token(name: str) -> str:
    """A client-chosen name (an A1111 field, a LoRA file name) as it appears inside a header: its UTF-8 bytes
    percent-encoded except ASCII letters, digits and ``-._~`` (RFC 3986's unreserved characters), so a name
    carries no space, separator (``,`` ``:`` ``;``), control or non-ASCII character into the value;
    ``urllib.parse.unquote`` gives the name back."""
    return quote(name, safe="", errors="replace")


def tokens(names: Iterable[str]) -> str:
    """Names as ``token``s, comma-separated."""
    return ",".join(token(n) for n in names)


def value(text: str) -> str:
    """``text`` as a header value every HTTP/1.1 stack takes: visible ASCII and inner spaces as they are, any
    other character (CR, LF, controls, non-ASCII) percent-encoded as UTF-8, outer whitespace dropped, cut at
    ``MAX_VALUE_CHARS`` (never inside a %XX)."""
    if len(text) <= MAX_VALUE_CHARS and (not text or _VALID.fullmatch(text)):
        return text
    encoded = "".join(c if " " <= c <= "~" else quote(c, safe="", errors="replace") for c in text).strip(" ")
    if len(encoded) > MAX_VALUE_CHARS:
        encoded = encoded[:MAX_VALUE_CHARS]
        cut = encoded.rfind("%", len(encoded) - 2)
        encoded = (encoded[:cut] if cut >= 0 else encoded).rstrip(" ")
    return encoded


def put(target: MutableHeaders, name: str, text: str) -> None:
    """Set ``name`` to ``value(text)``: the one way sdserve sets a header whose value holds client input."""
    target[name] = value(text)


def repaired(raw: bytes) -> bytes | None:
    """None when ``raw`` is a valid header value (RFC 9110 field-value, visible ASCII); else the value ``value``
    makes of it (its bytes read as Latin-1, as they were written)."""
    if _VALID_RAW.fullmatch(raw):
        return None
    return value(raw.decode("latin-1")).encode("ascii")
