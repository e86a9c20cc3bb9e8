"""The step scheduler's policy: plain request records in, decisions out (server/stepper.py runs them).

No event loop, no threads, no clock: the caller passes ``now`` and keeps one :class:`Record` per request (on the
request itself, ``Job.record``), refreshed with its progress before each decision. Every function here is a rule of
the policy, unit-tested on plain data (tests/unit/test_step_policy.py).

Policy: **smallest slowdown first, bounded bypass, deadline guard**.
- **Which operation runs next** (:func:`choose`): that of the request with the smallest *work left x whole work*,
  where work is images x (steps + ``FINISH_EVALS`` for the decode) x the size's work per step (pixels; a DiT's
  tokens); oldest first among equals. This is Smith's rule weighted by 1 / whole work: the order that keeps the sum
  of slowdowns (latency over solo latency) smallest. A 1-image 4-step request (6 x 6) that arrives while 4-image
  50-step requests run (208 x 208 at the start, 8 x 208 with only their decode left) is begun, ticked and decoded
  before any of their operations: it waits for the operation in flight only, never for a whole generation. Among
  requests of equal size the one with the least left goes first, and a request with only its decode left goes before
  longer work begins (a 1-image request's decode, 2 x 52, before a new 20-step one, 22 x 22). Across sets (sizes,
  LoRA sets) the same order holds: the set of the request that ranks first ticks.
  Why not round robin across sets or rows: it makes every request as slow as the total work in flight; why not
  FIFO: that is head-of-line blocking again; why not the work left alone (SRPT, best for the mean latency): a
  4-image request a few steps or a decode from its end then goes before a 1-image request that just arrived,
  which costs the short one about its own length again and the long one nothing it would notice.
- **A decode is split in parts** of ``decode_images`` images, each an operation of its own (:func:`left` counts
  the images not decoded yet): a short request that arrives while a 4-image request decodes waits for one image's
  decode, not four.
- **A tick is filled to the budget**: the lead row's set gives the call its other rows, least work first, until
  the call holds ``max_batch`` images (the TensorRT profiles and the memory plan are sized for it; a larger
  request runs alone). A queued request of that set that fits the room left begins first, so it joins this very
  call: a call of four images costs about twice one image's on a CPU, and about one image's on a GPU.
- **Bounded bypass** (:func:`count_bypass`): each operation run for a smaller request (less whole work) while a larger
  one could have run counts as one bypass of the larger one; after ``BYPASS_LIMIT`` bypasses in a row, the larger
  one's next operation goes first (then it counts again). A stream of short requests therefore takes at most that many
  operations in a row from a long one (which still fills their ticks when there is room), and never stops it. **Across
  sizes an operation counts by its size** (:func:`bypass_weight`): one of a smaller size counts as the ratio of the
  sizes' work per image-step (a 64x64 operation beside a 256x256 request: 1/16 of a bypass), so the bound is about the
  waiting request's own operation time, not a count of much shorter operations: a 64x64 request (22 operations) is
  never interrupted by a 256x256 job's tick, which would cost it several times its own length (a 4-image 256x256 tick
  is longer than the whole small request on a CPU). Within one size an operation counts whole, as before (a 1-image
  tick costs about a 4-image one's on a GPU). Requests of equal whole work do not count against each other: among them
  the one with the least left goes first, which finishes them in order without starving any (a later equal request has
  more left), so equal long requests do not push each other, or a starved one, ahead of short requests every few
  operations.
- **Deadline guard** (:func:`urgent`): a request is urgent, and goes first (earliest deadline first), when it would
  miss its deadline *because of the work that ranks before it* and would meet it going first: with the margin
  ``URGENT_FACTOR``, its own remaining seconds fit before its deadline and those plus the seconds of the work ranked
  before it (``Record.ahead_s``, :func:`prepare`) do not. Never because it is large: a request whose own remaining
  time alone is near its deadline gains nothing it can count on by going first over others, and a deadline it
  could meet after the work ahead (a client's ``x-sdserve-timeout-s`` included) grants nothing.
- **Fair share across tenants** (:class:`Share`): a request's tenant is its owner's label (one tenant without
  auth). Weighted fair queueing by work: each tenant with work has a virtual time, the work served to it
  (denoiser row-evaluations at its size, a decode priced ``FINISH_EVALS`` per image, a begin nothing) over its
  weight; the tenant with the least goes first, and within a tenant the order above holds (short first, the bypass
  bound, deadlines). Work-conserving: only tenants with work compete, so an idle tenant's share goes to the
  others; a tenant (re)joining starts at the least virtual time of the tenants with work, so a late one is not
  starved by one that queued a hundred jobs, and an idle one banks no credit. With one tenant with work no virtual
  time is stamped (``Record.vtime`` None) and the order is exactly the one above. Rows of other tenants still fill
  the lead's calls (and are charged for it).
- **Runs** (:func:`run_bound`, :func:`finish_next`): operations the loop would choose one after another with
  nothing new to decide on (the ticks of the same rows, the parts of one decode, then the finish of the row they
  completed when it ranks first) run back to back, at most ``MAX_RUN``: the order is the same. A run ends before a
  waiting request reaches its bypass limit or turns urgent, before a deadline, and before a queued request run whole
  is due; the loop also ends it when a request is queued, interrupted or gone, on a stop, and when a row finishes.
- **Residency** (:func:`candidates`): a queued request begins when its images fit ``max_running`` with the
  resident ones (or when nothing is resident).
- **Requests run whole** (step key ``WHOLE``: a pipeline without stages) take turns with the running sets
  (:class:`Turns`): one goes once every running set had an operation since the last one.

**One ranking function.** Every order the policy decides (the lead, the rows a tick takes, the runner-up that bounds
a run, the finish that ends one) compares :func:`rank` values and nothing else, so a new ordering rule (fairness
across tenants) is a change to :func:`rank` alone, plus the :class:`Record` field it reads. A rule whose rank moves
while a run goes on without news (as the bypass count and urgency do) also bounds runs in :func:`run_bound`.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

WHOLE = ("whole",)
"""The step key of requests the engine runs whole."""
BYPASS_LIMIT = 16
"""Operations a waiting request may be bypassed by smaller ones in a row before its own goes first."""
FINISH_EVALS = 2
"""A decode costs about this many denoiser evaluations of the same images (CPU and GPU alike, SD 1.5 to SDXL)."""
URGENT_FACTOR = 1.25
"""The deadline guard's margin on estimates: a request is urgent when its own remaining seconds x this fit before
its deadline and (those + the seconds ranked before it) x this do not."""
MAX_RUN = 64
"""Operations of one kind for the same rows run back to back in the engine's thread at most (a run)."""
FAIR_SLICE_S = 0.02
"""Fair share's granularity: a tenant's ticks estimated shorter than this run on, back to back in one thread call,
up to this many seconds past the point where its virtual time reaches another tenant's, instead of one event-loop
hop (a thread-pool round trip and a whole decision) per tick: with small ticks (64x64 on a CPU) fair share cost
throughput that way (benchmarks/bench_tenants.py). The share stays
exact in work over turns; at any instant a tenant is ahead by at most this slice plus one operation. A tick that
takes longer than the slice (a 512x512 step on a GPU) switches tenants after one operation, as without it."""
BEGIN, TICK, FINISH = "begin", "tick", "finish"
"""The operations: a request's begin, a tick of rows, a request's finish (or a part of its decode)."""

DEFAULT_TENANT = "default"
"""The tenant of a request without an owner (no auth)."""

Rank = tuple[float, ...]
"""Smaller goes first: (tier, key, enqueued), tier 0 first as interrupted, starved or urgent; prefixed by the
tenant's virtual time (vtime, tier, key, enqueued) while more than one tenant has work (``Record.vtime``)."""


@dataclass(eq=False)
class Record:
    """One request as the policy sees it: its size, its progress, and the scheduler's own counts, which live as
    long as the request (compared by identity)."""

    images: int
    steps: int
    """Its denoising steps (its whole work)."""
    scale: float = 1.0
    """Its work per image-step relative to 64x64 (pixels, or a DiT's tokens)."""
    enqueued: float = 0.0
    """When it was queued (monotonic): the oldest first among equals."""
    deadline: float | None = None
    """Monotonic; None: none."""
    key: Hashable | None = None
    """Its step key (``WHOLE``: run whole); None until the loop asked the engine."""
    steps_left: int | None = None
    """Denoising steps it has left; None while it is queued (not begun: all of them)."""
    finished: bool = False
    """Its denoising is over: its decode is left."""
    interrupted: bool = False
    """Interrupted (``/sdapi/v1/interrupt``): decoded where it is, first."""
    estimate_s: float | None = None
    """The cost model's estimate of its whole run in seconds (for the deadline guard); None: nothing measured."""
    decoded: int = 0
    """Its images decoded so far."""
    bypassed: float = 0.0
    """Operations run for smaller requests in a row while it waited, each weighted by :func:`bypass_weight`."""
    shared: int | None = None
    """The most images any tick of it ran with (its x-sdserve-batch-size); accounting, no rule reads it."""
    tenant: str = DEFAULT_TENANT
    """Whose it is (the job's owner label): fair share is across tenants, today's order within one."""
    ahead_s: float = 0.0
    """Estimated seconds of the work ranked before it (:func:`prepare`, each decision): the deadline guard's."""
    vtime: float | None = None
    """Its tenant's virtual time (:class:`Share`) while more than one tenant has work; None: fair share is moot."""

    @property
    def begun(self) -> bool:
        return self.steps_left is not None


def whole(r: Record) -> float:
    """Its whole work in image-evaluations at its size: images x (steps + ``FINISH_EVALS``) x scale."""
    return r.images * (r.steps + FINISH_EVALS) * r.scale


def left(r: Record) -> float:
    """Its remaining work in image-evaluations at its size: images x (steps left + its decode, about
    ``FINISH_EVALS`` evaluations); once its steps are done (or it was interrupted), the images not decoded yet x
    ``FINISH_EVALS``."""
    if r.steps_left is not None and (r.finished or r.interrupted):  # its decode only, what is left of it
        return (r.images - r.decoded) * FINISH_EVALS * r.scale
    steps = r.steps if r.steps_left is None else r.steps_left
    return r.images * (steps + FINISH_EVALS) * r.scale


def seconds_left(r: Record) -> float:
    """Its estimated remaining seconds: its estimate's share of the work left (0 when nothing was measured)."""
    return 0.0 if r.estimate_s is None else r.estimate_s * left(r) / whole(r)


def urgent(r: Record, now: float) -> bool:
    """The deadline guard: it would miss its deadline behind the work ranked before it but not going first, with
    the margin: own x ``URGENT_FACTOR`` <= time to its deadline < (own + ``ahead_s``) x ``URGENT_FACTOR``, own being
    :func:`seconds_left`. Not urgent: no deadline; nothing measured; a deadline it can meet after the work ahead
    (however near: a client's header alone grants nothing); a deadline its own remaining time alone (with the
    margin) already misses, since going first over others cannot be counted on to save it and would make every
    request wait out a large one."""
    if r.deadline is None or r.estimate_s is None:
        return False
    own, due_in = seconds_left(r), r.deadline - now
    return own * URGENT_FACTOR <= due_in < (own + r.ahead_s) * URGENT_FACTOR


def bypass_weight(lead: Record, waiting: Record) -> float:
    """What one operation led by ``lead`` counts as a bypass of ``waiting``: the ratio of their work per image-step
    (their sizes' pixels, or a DiT's tokens), at most 1. Within one size: 1."""
    return min(1.0, lead.scale / waiting.scale) if waiting.scale > 0 else 1.0


def _first(r: Record) -> bool:
    """Goes first within its tenant whatever the estimates say: interrupted, or starved (``BYPASS_LIMIT``)."""
    return r.interrupted or r.bypassed >= BYPASS_LIMIT - _EPS


_EPS = 1e-9
"""Slack for weighted bypass counts summed in floating point."""


def rank(r: Record, now: float) -> Rank:
    """The one ordering of the policy, smaller first: (0, deadline, enqueued) for an interrupted, starved
    (``BYPASS_LIMIT`` bypasses) or urgent request, else (1, work left x whole work, enqueued): Smith's rule with
    weights 1 / whole work, the order that keeps the sum of slowdowns smallest; among requests of equal work, the
    least left first, then the oldest. While more than one tenant has work, the tenant's virtual time comes first
    (weighted fair share, :class:`Share`): the tenant served least for its weight goes first, today's order within
    it."""
    due = r.deadline if r.deadline is not None else math.inf
    own: Rank = (0, due, r.enqueued) if _first(r) or urgent(r, now) else (1, left(r) * whole(r), r.enqueued)
    return own if r.vtime is None else (r.vtime, *own)


def _base(r: Record) -> Rank:
    """Its rank without the deadline guard: the order the work ahead of a request is counted in."""
    due = r.deadline if r.deadline is not None else math.inf
    return (0, due, r.enqueued) if _first(r) else (1, left(r) * whole(r), r.enqueued)


@dataclass
class Share:
    """Weighted fair share across tenants (policy-owned state, one per scheduler): each tenant with work has a
    virtual time, the work served to it over its weight. ``weights``: label -> weight (unknown label: 1.0)."""

    weights: Mapping[str, float] = field(default_factory=dict)
    vtimes: dict[str, float] = field(default_factory=dict)
    """The tenants with work at the last :meth:`active` and their virtual times."""

    def weight(self, tenant: str) -> float:
        w = self.weights.get(tenant, 1.0)
        return w if w > 0 else 1.0

    def active(self, tenants: Iterable[str]) -> None:
        """The tenants with work now: one that (re)joins starts at the least virtual time of those that had work
        and still have (0 when none); one without work is forgotten (no credit banked, no debt kept)."""
        now = set(tenants)
        kept = {t: v for t, v in self.vtimes.items() if t in now}
        start = min(kept.values(), default=0.0)
        self.vtimes = {t: kept.get(t, start) for t in sorted(now)}

    def serve(self, tenant: str, work: float) -> None:
        """``work`` (row-evaluations at its size) was served to ``tenant``."""
        if tenant in self.vtimes:
            self.vtimes[tenant] += work / self.weight(tenant)

    def charge(self, kind: str, ran: Iterable[Record], times: int, decode_images: int) -> None:
        """``times`` operations of ``kind`` ran ``ran``: a tick serves each row its images x scale, a decode (part
        or finish) ``FINISH_EVALS`` per image it decodes (at most ``decode_images`` a part), a begin nothing."""
        for r in ran:
            if kind == TICK:
                self.serve(r.tenant, times * r.images * r.scale)
            elif kind == FINISH:
                images = r.images if r.interrupted else min(r.images, times * decode_images)
                self.serve(r.tenant, images * FINISH_EVALS * r.scale)

    def stamp(self, records: Iterable[Record]) -> None:
        """Each record's ``vtime``: its tenant's, while more than one tenant has work; else None."""
        fair = len(self.vtimes) > 1
        for r in records:
            r.vtime = self.vtimes.get(r.tenant, 0.0) if fair else None


def prepare(records: Sequence[Record], share: Share | None = None) -> None:
    """Before a decision, with every request's record (running and queued, synced): the tenants with work, each
    record's virtual time and its ``ahead_s`` (:func:`waits`)."""
    if share is not None:
        share.active(r.tenant for r in records)
        share.stamp(records)
    ahead = waits(records, share)
    for r in records:
        r.ahead_s = ahead[id(r)]


def waits(records: Sequence[Record], share: Share | None = None) -> dict[int, float]:
    """Each record's estimated wait in seconds (by ``id``): the remaining seconds of its tenant's requests ranked
    before it (:func:`rank` without the deadline guard), plus, for each other tenant with work, what fair share
    lets it run meanwhile: its remaining seconds, at most (this wait + own) x its weight / this tenant's weight."""
    by_tenant: dict[str, list[Record]] = {}
    for r in records:
        by_tenant.setdefault(r.tenant, []).append(r)
    totals = {t: sum(map(seconds_left, rs)) for t, rs in by_tenant.items()}
    found: dict[int, float] = {}
    for rs in by_tenant.values():
        before = 0.0
        for r in sorted(rs, key=_base):
            found[id(r)] = before
            before += seconds_left(r)
    if len(by_tenant) > 1:
        weight = share.weight if share is not None else (lambda t: 1.0)
        for r in records:
            mine, span = weight(r.tenant), found[id(r)] + seconds_left(r)
            found[id(r)] += sum(min(total, span * weight(t) / mine) for t, total in totals.items() if t != r.tenant)
    return found


@dataclass
class Candidate(Generic[T]):
    """A request with an operation it could run now: ``kind`` in the running set ``key`` (a begin: its own key)."""

    kind: str
    record: Record
    key: Hashable
    item: T
    """The caller's request; the policy never reads it."""


@dataclass
class Decision(Generic[T]):
    """What runs next: ``kind`` for ``lead`` (a tick also runs ``rows``, the lead's included)."""

    kind: str
    lead: Candidate[T]
    rows: list[Candidate[T]]
    waiting: list[Record] = field(default_factory=list)
    """Every request that had an operation it could run (bypass counts)."""
    first: bool = False
    """The lead goes first as interrupted, starved or urgent (tier 0): the loop decides again after it."""
    runner_up: Rank | None = None
    """The best rank among the candidates this operation leaves out (None: none)."""

    @property
    def ran(self) -> list[Record]:
        return [c.record for c in self.rows]


def candidates(running: Mapping[Hashable, Sequence[tuple[Record, T]]], queued: Iterable[tuple[Record, T]],
               max_running: int) -> list[Candidate[T]]:
    """Every request with an operation it could run now, in this order: the resident rows of each running set
    (tick; finish once its denoising is over or it was interrupted), then the queued requests of a known step key
    that is not ``WHOLE`` whose images fit ``max_running`` with the resident ones (begin; anything fits when
    nothing is resident)."""
    found: list[Candidate[T]] = []
    resident = 0
    for key, rows in running.items():
        for record, item in rows:
            done = not record.begun or record.finished or record.interrupted
            found.append(Candidate(FINISH if done else TICK, record, key, item))
            resident += record.images
    for record, item in queued:
        if record.key is None or record.key == WHOLE:
            continue
        if not resident or resident + record.images <= max_running:
            found.append(Candidate(BEGIN, record, record.key, item))
    return found


def choose(found: Sequence[Candidate[T]], now: float, max_batch: int,
           rooms: Mapping[Hashable, int] | None = None) -> Decision[T] | None:
    """The next operation among ``found`` (None: nothing can run): that of the best-ranked request. A tick takes
    the lead's set's other ticking rows in rank order while the call holds at most ``max_batch`` images (or its
    key's ``rooms`` entry: fewer where the memory budget says; a lead larger than that runs alone); a queued
    request of that set that fits the room left begins first instead (so it joins this very call)."""
    if not found:
        return None
    ranked = sorted((rank(c.record, now), k) for k, c in enumerate(found))  # each rank once
    order = [found[k] for _, k in ranked]
    lead = order[0]
    op = Decision(lead.kind, lead, [lead], [c.record for c in found], ranked[0][0][-3] == 0)  # its own tier
    if lead.kind == TICK:
        images, room = lead.record.images, (rooms or {}).get(lead.key, max_batch)
        for other in order[1:]:
            if other.kind == TICK and other.key == lead.key and images + other.record.images <= room:
                op.rows.append(other)
                images += other.record.images
        for other in order[1:]:  # a queued request that fits the call's room begins first
            if other.kind == BEGIN and other.key == lead.key and images + other.record.images <= room:
                return Decision(BEGIN, other, [other], op.waiting, op.first)
    ran = {id(c.record) for c in op.rows}
    op.runner_up = next((p for p, k in ranked if id(found[k].record) not in ran), None)
    return op


def count_bypass(lead: Record, ran: Iterable[Record], waiting: Iterable[Record], times: int) -> None:
    """Bypass accounting after ``times`` operations led by ``lead`` that ran ``ran``: every waiting request of the
    lead's tenant with more whole work than the lead's is bypassed that many times more (:func:`bypass_weight`
    each); one that ran starts counting again; one of equal or less whole work does not count, nor one of another
    tenant (fair share bounds what another tenant's work takes from it)."""
    bar = whole(lead)
    rows = {id(r) for r in ran}
    for r in waiting:
        if id(r) in rows:
            r.bypassed = 0.0
        elif whole(r) > bar and r.tenant == lead.tenant:
            r.bypassed += times * bypass_weight(lead, r)


def run_bound(op: Decision[T], others: Iterable[Record], now: float, whole_in: int | None = None,
              share: Share | None = None, decode_images: int = 1) -> tuple[int, float]:
    """How many operations like ``op`` (a tick of the same rows, the next parts of the same decode) may run back to
    back, and until when (monotonic): with nothing new, they are what :func:`choose` would pick one by one, since the
    rows they run only move further ahead of the rest. What changes the choice without news bounds them: a waiting
    request of the lead's tenant reaching its bypass limit (the count), a queued request run whole becoming due
    (``whole_in``: operations until its turn, None: none queued), the lead's tenant's virtual time reaching another
    tenant's, then ``FAIR_SLICE_S`` more of short ticks (the count: fair share), a deadline among ``others`` (every
    row and queued request) passing or one of them turning urgent (the time; the work ahead of it only shrinks
    meanwhile). A lead that goes first (tier 0) runs one. At least one, at most ``MAX_RUN``."""
    if op.first:
        return 1, now
    rows = {id(r) for r in op.ran}
    lead = op.lead.record
    bar = whole(lead)
    most, until = MAX_RUN, math.inf
    for r in op.waiting:
        if id(r) not in rows and whole(r) > bar and r.tenant == lead.tenant:
            most = min(most, math.ceil((BYPASS_LIMIT - r.bypassed) / bypass_weight(lead, r) - _EPS))
    if whole_in is not None:
        most = min(most, whole_in)
    if share is not None and lead.vtime is not None:
        most = min(most, _fair_bound(op, share, decode_images))
    for r in others:
        if r.deadline is None:
            continue
        until = min(until, r.deadline)
        if id(r) not in rows and r.estimate_s is not None:
            until = min(until, r.deadline - URGENT_FACTOR * (seconds_left(r) + r.ahead_s))
    return max(1, most), until


def _fair_bound(op: Decision[T], share: Share, decode_images: int) -> int:
    """Operations like ``op`` after which its lead's tenant's virtual time is still below every other waiting
    tenant's (each one advances it by its rows' work over its weight): within it the lead's tenant ranks first."""
    lead = op.lead.record
    gap = min((r.vtime for r in op.waiting if r.tenant != lead.tenant and r.vtime is not None), default=math.inf)
    trial = Share(share.weights, {lead.tenant: 0.0})
    trial.charge(op.kind, [r for r in op.ran if r.tenant == lead.tenant], 1, decode_images)
    step = trial.vtimes[lead.tenant]
    if step <= 0 or gap == math.inf:
        return MAX_RUN
    return max(1, math.ceil((gap - (lead.vtime or 0.0)) / step)) + _slice_ops(op)


def _slice_ops(op: Decision[T]) -> int:
    """Ticks of ``op``'s rows that fit ``FAIR_SLICE_S`` by their estimates (a tick of a row: its estimate over its
    steps + decode); 0 for a decode, or a row not measured yet."""
    if op.kind != TICK or any(r.estimate_s is None for r in op.ran):
        return 0
    tick_s = sum((r.estimate_s or 0.0) / (r.steps + FINISH_EVALS) for r in op.ran)
    return int(FAIR_SLICE_S / tick_s) if tick_s > 0 else 0


def finish_next(ran: Sequence[Record], now: float, runner_up: Rank | None, decode_images: int) -> int | None:
    """After a run within its bounds: the index in ``ran`` (the rows it ran, their progress as of now) of the one
    whose finish :func:`choose` would pick next, or None. It must rank first among them and before ``runner_up``
    (the best rank the run left out: ranks do not move within the bounds), have its denoising over (not
    interrupted: that finish is the loop's) and at most one part of its decode left. The rows' bypass counts start
    again first, as :func:`count_bypass` does after the run."""
    for r in ran:
        r.bypassed = 0.0
    best, k = min((rank(r, now), k) for k, r in enumerate(ran))
    r = ran[k]
    if (not r.begun or not r.finished or r.interrupted or (runner_up is not None and not best < runner_up)
            or r.images - r.decoded > decode_images):
        return None
    return k


@dataclass
class Turns:
    """Round robin between requests run whole and the running sets: a request run whole is due once every running
    set had an operation since the last one ran (at once when none did yet)."""

    since: int = 1 << 30
    """Operations since a request last ran whole."""

    def due(self, sets: int) -> bool:
        return self.since >= sets

    def took(self) -> None:
        """A request runs whole now."""
        self.since = 0

    def ran(self, times: int) -> None:
        """``times`` operations of the running sets ran."""
        self.since += times

    def left(self, sets: int) -> int:
        """Operations until a queued request run whole is due (at most 0: due)."""
        return sets - self.since
