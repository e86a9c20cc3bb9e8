"""Strict JSON request bodies (duplicate keys, oversized numbers, NaN, lone surrogates, too many keys: 400/422),
checked after the body cap has read the body whole and before the app parses it; large bodies parse in a worker
thread, and a refusal leaves nothing for the cyclic GC (``parse_body``). On the A1111 routes a body sent without a
Content-Type is read as JSON, as A1111 reads it (``as_json``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from starlette.concurrency import run_in_threadpool

from engines.errors import InvalidRequestError
from server.middleware import ASGIApp, Receive, Scope, Send, answer, replay

MAX_NUMBER_CHARS = 32
"""A JSON number longer than this is refused before Python parses it (int() of thousands of digits is slow and
raises a message of its own)."""


def _bounded(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        if len(text) > MAX_NUMBER_CHARS:
            raise InvalidRequestError(f"a number in the request body is longer than {MAX_NUMBER_CHARS} characters")
        return kind(text)

    return parse


MAX_OBJECT_KEYS = 1000
"""Keys one JSON object may hold: no route takes more than a few dozen, and refusing at parse time keeps a body of
100,000 unknown keys from costing 100,000 validation errors."""
OFF_LOOP_BYTES = 64 << 10
"""Bodies at least this large are parsed in a worker thread, so a burst of them never stalls the probes."""


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    if len(pairs) > MAX_OBJECT_KEYS:
        raise InvalidRequestError(f"a JSON object in the request body has {len(pairs)} keys; at most "
                                  f"{MAX_OBJECT_KEYS} are accepted")
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise InvalidRequestError(f"{key}: duplicate key in the request body", param=key)
        seen[key] = value
    return seen


def _constant(name: str) -> float:
    raise InvalidRequestError(f"{name} is not a JSON number")


def _check_text(value: Any, where: str) -> None:
    """Every string must be valid Unicode text: a lone UTF-16 surrogate (JSON "\\ud800") is refused."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise InvalidRequestError(f"{where or 'body'}: contains an unpaired UTF-16 surrogate",
                                      param=where or None) from None
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_text(key, where)
            _check_text(item, f"{where}.{key}" if where else key)
    elif isinstance(value, list):
        for item in value:
            _check_text(item, where)


def strict_loads(body: bytes) -> Any:
    """json.loads that refuses what the standard library lets through: duplicate keys, NaN/Infinity, numbers of
    unbounded length and lone surrogates. Raises InvalidRequestError, or ValueError for text that is not JSON."""
    value = json.loads(body, object_pairs_hook=_pairs, parse_int=_bounded(int), parse_float=_bounded(float),
                       parse_constant=_constant)
    _check_text(value, "")
    return value


NOT_JSON = object()
"""parse_body's value for a body that is not JSON at all (the app's own validation answers it)."""


def parse_body(body: bytes) -> tuple[Any, InvalidRequestError | None]:
    """``strict_loads`` as a value: ``(value, None)``, ``(NOT_JSON, None)``, or ``(None, refusal)``.

    The refusal is returned without its traceback, never raised: raised from ``object_pairs_hook``, its traceback
    holds the parser's frames and with them every key pair of the object being built, and once re-raised through
    the threadpool's future and the awaiting coroutines those frames sit in a reference cycle that only the cyclic
    GC frees (~14 MB per 1,000-key body, issue 32). Dropping the traceback here frees them by reference count."""
    refusal: InvalidRequestError | None = None
    try:
        return strict_loads(body), None
    except InvalidRequestError as exc:
        refusal = exc.with_traceback(None)
        refusal.__context__ = None
    except (UnicodeDecodeError, RecursionError) as exc:  # the app would answer an undocumented 400 / a 500
        what = "is not UTF-8 text" if isinstance(exc, UnicodeDecodeError) else "is nested too deeply"
        refusal = InvalidRequestError(f"request body is not valid JSON: it {what}")
    except ValueError:
        return NOT_JSON, None
    return None, refusal


def _is_json(scope: Scope) -> bool:
    content_type = dict(scope.get("headers", [])).get(b"content-type", b"application/json").decode("latin-1")
    media: str = content_type.split(";")[0].strip().lower()
    return media == "application/json" or media.endswith("+json")


A1111_PREFIX = "/sdapi/"
"""The A1111 routes: there a JSON body without a Content-Type is read as JSON (``as_json``)."""


def as_json(scope: Scope) -> Scope:
    """The scope of a request to an A1111 route that sent no Content-Type, with ``application/json`` added: A1111's
    FastAPI (0.94) parses such a body as JSON and clients rely on it (Dify's Stable Diffusion tool posts
    ``data=json.dumps(...)`` through requests, which sets none); today's FastAPI does not. Other routes, and any
    request that names a Content-Type, are left as they are (a body that is then not JSON is still a 422)."""
    headers = scope.get("headers", [])
    if not str(scope.get("path", "")).startswith(A1111_PREFIX) or any(k == b"content-type" for k, _ in headers):
        return scope
    return {**scope, "headers": [*headers, (b"content-type", b"application/json")]}


class StrictJsonMiddleware:
    """JSON request bodies are checked by ``strict_loads`` before the app parses them (after the body cap, which
    has read the body whole); a body that is not JSON at all is left to the app's own 400. With ``keep_prompt``
    (``server.log_prompts``) a body's ``prompt`` is kept in the request state for the access log."""

    def __init__(self, app: ASGIApp, keep_prompt: bool = False) -> None:
        self.app, self.keep_prompt = app, keep_prompt

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD", "OPTIONS") or not _is_json(scope):
            await self.app(scope, receive, send)
            return
        scope = as_json(scope)
        message = await receive()
        if message["type"] != "http.request":  # disconnected: nobody to answer
            return
        body = message.get("body", b"")
        if body:
            value, refusal = await run_in_threadpool(parse_body, body) if len(body) >= OFF_LOOP_BYTES \
                else parse_body(body)
            if refusal is not None:
                await answer(refusal, scope, receive, send)
                return
            if self.keep_prompt and isinstance(value, dict) and isinstance(value.get("prompt"), str):
                scope.setdefault("state", {})["prompt"] = value["prompt"]
            del value  # the app parses the body again; this copy need not live as long as the request
        await self.app(scope, replay(body, receive), send)
