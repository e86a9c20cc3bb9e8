"""Connection bounds against hostile clients: uvicorn's h11 protocol with deadlines, a connection cap, evictions
and probe slots (server/launcher.py builds the server with them).

Hostile clients: a connection that has not sent a complete request head within ``server.header_timeout_s`` is closed
(uvicorn's own keep-alive timer starts only after a first response), and a body must arrive whole within
``server.body_timeout_s`` (408, server/middleware.py); open connections are capped below RLIMIT_NOFILE: one over the
cap closes the oldest connection that has waited ``HEAD_GRACE_S`` without a complete request head, else one whose
reply is stuck, else the oldest still sending its body (so probes keep answering under an idle or slow-body flood),
or is refused at once with a 503 when every connection is busy. A connection younger than ``HEAD_GRACE_S`` without
its head is never closed by the cap: a probe sends its head with the connection, but under connection churn (130-270
new connections a second with the cap held by slow bodies) the event loop accepts the next connections before it
reads that head, and closing "the oldest without a head" closed the probe (11-42% of probes reset: issue 43).
A reply the client does not take (a slow reader: a tiny receive window, pipelined requests it never reads) is
bounded too: when the connection stops taking bytes (the buffer over its high-water mark), or its response ends
with bytes still buffered, and the client has not taken them down (to the low-water mark, or all of them) within
``server.write_timeout_s``, the connection is reset and its buffer dropped (``transport.close()`` would wait for
the buffer to drain, holding the slot); such connections are evictable after idle ones. The bytes such replies hold
are bounded across connections too (``server.max_unread_reply_mb``): past it, the connections holding unread bytes
longest are reset first, so clients that never read cannot pin memory by numbers before their timeout (64 of them
on one amplified png-info reply each held 470 MB for 30 s: issue 57); probes hold nothing unread and are never cut.
``server.probe_slots`` connections beyond the cap take only probes (GET/HEAD /health or /ready, decided on the
request line's first bytes), one request each, so no client behaviour can take the probes' way in. Accepted sockets
get TCP_NODELAY."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from dataclasses import dataclass, field
from typing import Any

import h11
import uvicorn
from fastapi import FastAPI
from uvicorn.protocols.http.h11_impl import H11Protocol

conn_log = logging.getLogger("sdserve.connections")
REFUSAL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\nconnection: close\r\n"
           b"retry-after: 1\r\ncontent-length: 20\r\n\r\ntoo many connections")
PROBE_LINES = tuple(f"{method} {path}{end}".encode() for method in ("GET", "HEAD") for path in ("/health", "/ready")
                    for end in (" ", "?"))
"""Request lines a probe slot serves (the bytes a request head starts with)."""
PROBE_HEAD_S = 2.0
"""A probe slot's request head must arrive within this (a kubelet probe sends it with the connection)."""
HEAD_GRACE_S = 1.0
"""A connection without a request head is evictable by the cap only after waiting this long for it (an idle
kept-alive connection: this long after its last response)."""


@dataclass
class Bounds:
    """Connection limits shared by every connection of one server."""

    max_connections: int
    header_timeout_s: float
    write_timeout_s: float = 3600.0
    probe_slots: int = 0
    waiting: dict[BoundedH11Protocol, float] = field(default_factory=dict)
    """Connections with no complete request head yet, oldest first, and since when (loop time) they wait."""
    stalled: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections whose client stopped taking a reply (writing paused), oldest first (evicted next)."""
    reading: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections whose request head arrived but whose body is still coming, oldest first (evicted last)."""
    probes: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections in a probe slot (beyond the cap), oldest first."""
    max_unread_bytes: int = 1 << 62
    """Reply bytes all connections together may hold that their clients have not taken (server.max_unread_reply_mb)."""
    unread: dict[BoundedH11Protocol, None] = field(default_factory=dict)
    """Connections holding reply bytes their client has not taken (stalled, or a response ended with bytes still
    buffered), oldest first."""

    def hold(self, conn: BoundedH11Protocol) -> None:
        """``conn`` holds unread reply bytes: while all such connections hold more than ``max_unread_bytes``, the
        one holding them longest is reset (its buffer dropped)."""
        self.unread.setdefault(conn, None)
        total = sum(c.transport.get_write_buffer_size() for c in self.unread)
        while total > self.max_unread_bytes and self.unread:
            oldest = next(iter(self.unread))
            total -= oldest.transport.get_write_buffer_size()
            conn_log.warning("replies held unread by clients exceed %d bytes (server.max_unread_reply_mb): cutting "
                             "off the connection holding one longest", self.max_unread_bytes)
            oldest.expire()

    def evictable(self, now: float) -> BoundedH11Protocol | None:
        """The connection an over-cap one may close: the oldest that has waited ``HEAD_GRACE_S`` (at loop time
        ``now``) for its head, else one whose reply is stuck, else the oldest still sending a body; never one in a
        probe slot, never one that may be a probe whose head is not read yet."""
        oldest = next(((c, since) for c, since in self.waiting.items() if c not in self.probes), None)
        if oldest is not None and now - oldest[1] >= HEAD_GRACE_S:  # the rest waited less: oldest first
            return oldest[0]
        for table in (self.stalled, self.reading):
            found = next((c for c in table if c not in self.probes), None)
            if found is not None:
                return found
        return None

    def over_cap(self, open_now: int) -> bool:
        return open_now - len(self.probes) > self.max_connections

    def probe_slot(self) -> bool:
        """Whether a new connection can have a probe slot (the oldest probe still without its head gives way)."""
        if len(self.probes) < self.probe_slots:
            return True
        oldest = next((p for p in self.probes if p in self.waiting), None)
        if oldest is not None:
            oldest.expire()
        return oldest is not None


class BoundedConfig(uvicorn.Config):
    """uvicorn's config with the connection bounds every connection of the server shares."""

    def __init__(self, app: FastAPI, bounds: Bounds, **kwargs: Any) -> None:
        super().__init__(app, http=BoundedH11Protocol, **kwargs)
        self.bounds = bounds


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a request-head timeout and the connection cap (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, server_state: Any, app_state: dict[str, Any],
                 _loop: asyncio.AbstractEventLoop | None = None) -> None:
        super().__init__(config, server_state, app_state, _loop)
        self.bounds: Bounds = config.bounds if isinstance(config, BoundedConfig) else Bounds(1 << 30, 3600.0)
        self.head_timer: asyncio.TimerHandle | None = None
        self.write_timer: asyncio.TimerHandle | None = None
        self.seen_cycle: object = None
        self.probe_line: bytes | None = None
        """In a probe slot: the request line's first bytes seen so far (None: not in a probe slot)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        nodelay(transport)
        if self.bounds.over_cap(len(self.connections)):
            oldest = self.bounds.evictable(self.loop.time())
            if oldest is not None:
                conn_log.warning("connection cap %d reached: closing the oldest connections still sending a "
                                 "request head or body, or not taking their reply", self.bounds.max_connections)
                oldest.expire()
            elif self.bounds.probe_slot():  # every connection is busy: this one may still ask for a probe
                self.bounds.probes[self] = None
                self.probe_line = b""
            else:  # every connection and probe slot is busy: refuse this one, fast
                conn_log.warning("connection cap %d reached with every connection busy: refusing new connections",
                                 self.bounds.max_connections)
                transport.write(REFUSAL)
                transport.close()
                return
        self.await_head()

    def await_head(self) -> None:
        self.bounds.waiting.pop(self, None)
        self.bounds.waiting[self] = self.loop.time()
        if self.head_timer is not None:
            self.head_timer.cancel()
        timeout = self.bounds.header_timeout_s
        if self.probe_line is not None:
            timeout = min(PROBE_HEAD_S, timeout)
        self.head_timer = self.loop.call_later(timeout, self.expire)

    def head_arrived(self) -> None:
        self.seen_cycle = self.cycle
        self.bounds.waiting.pop(self, None)
        if self.head_timer is not None:
            self.head_timer.cancel()
            self.head_timer = None

    def expire(self) -> None:
        """No complete request head in time, a reply not taken in time, or evicted by the cap: close, dropping
        what is still buffered (a plain close would wait for a client that never reads)."""
        self.forget()
        if self.transport.get_write_buffer_size():
            reset(self.transport)
        elif not self.transport.is_closing():
            self.transport.close()

    def forget(self) -> None:
        for table in (self.bounds.waiting, self.bounds.stalled, self.bounds.reading, self.bounds.probes,
                      self.bounds.unread):
            table.pop(self, None)

    def data_received(self, data: bytes) -> None:
        if self.probe_line is not None and not self.probe_request(data):
            return
        super().data_received(data)
        if self.cycle is not None and self.cycle is not self.seen_cycle:
            self.head_arrived()
        self.track_body()

    def probe_request(self, data: bytes) -> bool:
        """In a probe slot: whether these bytes may go on (a probe's request line, or the start of one); anything
        else gets the 503 refusal. One request per probe slot: nothing after its head is served."""
        assert self.probe_line is not None
        if self.cycle is not None:
            return False
        if not any(self.probe_line.startswith(line) for line in PROBE_LINES):  # not known to be a probe yet
            self.probe_line = (self.probe_line + data)[:16]
            if not any(line.startswith(self.probe_line) or self.probe_line.startswith(line) for line in PROBE_LINES):
                self.forget()
                self.transport.write(REFUSAL)
                self.transport.close()
                return False
        return True

    def track_body(self) -> None:
        if self.conn.their_state is h11.SEND_BODY and not self.transport.is_closing():
            self.bounds.reading.setdefault(self, None)
        else:
            self.bounds.reading.pop(self, None)

    def on_response_complete(self) -> None:
        if self.probe_line is not None:  # one request per probe slot: answered, then closed
            self.transport.close()
        super().on_response_complete()  # may start a pipelined request
        if self.transport.get_write_buffer_size():  # the client has not taken all of it yet
            self.arm_write_deadline()
            self.bounds.hold(self)
        else:
            self.disarm_write_deadline()
            self.bounds.unread.pop(self, None)
        self.track_body()
        if self.cycle is not self.seen_cycle:
            self.head_arrived()
        elif not self.transport.is_closing():
            self.await_head()

    def pause_writing(self) -> None:
        """The client stopped taking the reply (the transport's buffer is over its high-water mark)."""
        super().pause_writing()
        self.bounds.stalled[self] = None
        self.arm_write_deadline()
        self.bounds.hold(self)

    def resume_writing(self) -> None:
        """The client took the buffer down to the low-water mark (48 KiB or more since the pause): the stall is
        over. A byte now and then does not end it, so a client that barely reads is still cut off."""
        super().resume_writing()
        self.bounds.stalled.pop(self, None)
        self.bounds.unread.pop(self, None)
        self.disarm_write_deadline()

    def arm_write_deadline(self) -> None:
        if self.write_timer is None:
            self.write_timer = self.loop.call_later(self.bounds.write_timeout_s, self.write_expired)

    def disarm_write_deadline(self) -> None:
        if self.write_timer is not None:
            self.write_timer.cancel()
            self.write_timer = None

    def write_expired(self) -> None:
        self.write_timer = None
        if self.transport.get_write_buffer_size() or self.flow.write_paused:
            conn_log.warning("a client did not take its reply within %.0fs (server.write_timeout_s): connection "
                             "cut off", self.bounds.write_timeout_s)
            self.expire()

    def connection_lost(self, exc: Exception | None) -> None:
        self.forget()
        for timer in (self.head_timer, self.write_timer):
            if timer is not None:
                timer.cancel()
        super().connection_lost(exc)


def nodelay(transport: asyncio.BaseTransport) -> None:
    """TCP_NODELAY on an accepted socket. asyncio sets it only for sockets it creates with proto IPPROTO_TCP;
    ours is bound by hand (proto 0), and without it Nagle holds each response's body behind its headers until
    the client's delayed ACK (~40 ms on every kept-alive request)."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        with contextlib.suppress(OSError):  # the peer already went away
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def reset(transport: asyncio.Transport) -> None:
    """Abort with a reset: SO_LINGER 0 makes the kernel drop what it still holds for the peer too (after a plain
    abort it keeps sending that, then a FIN, to a client that never reads)."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
