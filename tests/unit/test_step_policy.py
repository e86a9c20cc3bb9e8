"""The step scheduler's policy (server/step_policy.py) on plain records: no event loop, no threads, no engine. Each
rule the loop runs (tests/unit/test_stepper.py shows them on the app) is a decision computed here: the order by work
left x whole work, the filled tick, the bounded bypass, the deadline guard, the bounds of a run, the finish that
ends one, residency and the turns of requests run whole."""

from __future__ import annotations

import math
from typing import Any

from server.step_policy import (
    BEGIN,
    BYPASS_LIMIT,
    FINISH,
    MAX_RUN,
    TICK,
    URGENT_FACTOR,
    WHOLE,
    Candidate,
    Decision,
    Record,
    Turns,
    bypass_weight,
    candidates,
    choose,
    count_bypass,
    finish_next,
    left,
    prepare,
    rank,
    run_bound,
    urgent,
    whole,
)

KEY = "64x64"
NOW = 1000.0


def rec(images: int = 1, steps: int = 20, *, at: float = 0.0, done: int | None = None, **kw: Any) -> Record:
    """A request of ``images`` x ``steps`` queued at ``at``; ``done``: begun, with that many steps run."""
    record = Record(images, steps, enqueued=at, key=kw.pop("key", KEY), **kw)
    if done is not None:
        record.steps_left = steps - done
        record.finished = done >= steps
    return record


def row(name: str, record: Record, key: str = KEY) -> Candidate[str]:
    """A resident row's candidate, as ``candidates`` makes it."""
    return candidates({key: [(record, name)]}, [], 64)[0]


def queued(name: str, record: Record) -> Candidate[str]:
    return Candidate(BEGIN, record, record.key, name)


def test_work_counts_images_steps_the_decode_and_the_size() -> None:
    assert whole(rec(4, 50)) == 4 * 52
    assert left(rec(4, 50)) == 4 * 52  # queued: all of it
    assert left(rec(4, 50, done=10)) == 4 * 42
    assert left(rec(4, 1, done=1)) == 4 * 2  # its decode only
    assert left(rec(4, 1, done=1, decoded=3)) == 1 * 2  # the image not decoded yet
    assert left(rec(1, 40, done=5, interrupted=True)) == 2  # an interrupted row is decoded where it is
    assert whole(rec(1, 3, scale=4.0)) == 20.0  # 128x128: four times the pixels


def test_the_least_work_left_times_whole_work_goes_first() -> None:
    """A 1-image 4-step request (6 x 6) before a 4-image 50-step one just begun (208 x 208) and before its decode
    (8 x 208): it waits for the operation in flight only."""
    short, long = rec(1, 4, at=2.0), rec(4, 50, done=1, at=1.0)
    assert rank(short, NOW) == (1, 36.0, 2.0)
    assert rank(long, NOW) == (1, 4 * 51 * 208.0, 1.0)
    decoding = rec(4, 50, done=50, at=1.0)
    assert rank(decoding, NOW) == (1, 8 * 208.0, 1.0)
    op = choose([row("long", decoding), queued("short", short)], NOW, 4)
    assert op is not None and (op.kind, op.lead.item) == (BEGIN, "short")


def test_not_the_work_left_alone_a_long_requests_decode_waits_for_a_new_short_one() -> None:
    """SRPT would decode the 4-image 50-step request first (8 left against a new 1-image 20-step one's 22); work
    left x whole work does not (22 x 22 against 8 x 208): the short one would wait about its own length again."""
    decoding, short = rec(4, 50, done=50), rec(1, 20, at=5.0)
    assert left(decoding) < left(short)
    assert rank(short, NOW) < rank(decoding, NOW)


def test_a_decode_left_goes_before_longer_work_begins() -> None:
    """A 1-image request with its decode left (2 x 52) before a new 20-step one (22 x 22)."""
    op = choose([row("done", rec(1, 50, done=50)), queued("new", rec(1, 20, at=9.0))], NOW, 4)
    assert op is not None and (op.kind, op.lead.item) == (FINISH, "done")


def test_among_equals_the_oldest_goes_first_and_equal_sizes_go_by_the_least_left() -> None:
    a, b = rec(1, 10, at=1.0), rec(1, 10, at=2.0)
    op = choose([queued("b", b), queued("a", a)], NOW, 4)
    assert op is not None and op.lead.item == "a"
    ahead, behind = rec(1, 10, done=6, at=3.0), rec(1, 10, done=2, at=1.0)
    assert rank(ahead, NOW) < rank(behind, NOW)


def test_across_sets_the_set_of_the_best_ranked_row_ticks() -> None:
    """A 3-step request at 128x128 (scale 4: 5 x 4 each way) before a 4-image 6-step one at 64x64 (32 x 32)."""
    big, other = rec(4, 6, done=1), rec(1, 3, done=0, scale=4.0, key="128x128")
    found = [*candidates({KEY: [(big, "big")], "128x128": [(other, "other")]}, [], 64)]
    op = choose(found, NOW, 4)
    assert op is not None and (op.kind, op.lead.item, [c.item for c in op.rows]) == (TICK, "other", ["other"])


def test_a_tick_is_filled_to_the_budget_from_the_leads_set_the_least_work_first() -> None:
    rows = [(rec(1, 30, done=1, at=1.0), "a"), (rec(1, 10, done=1, at=2.0), "b"), (rec(1, 4, done=1, at=3.0), "c"),
            (rec(2, 40, done=1, at=4.0), "d")]
    found = candidates({KEY: rows, "other": [(rec(1, 2, done=1, key="other", at=5.0), "e")]}, [], 64)
    op = choose(found, NOW, 4)
    assert op is not None and op.lead.item == "e"  # the other set leads: its row alone
    assert [c.item for c in op.rows] == ["e"]
    op = choose([c for c in found if c.item != "e"], NOW, 4)
    assert op is not None and [c.item for c in op.rows] == ["c", "b", "a"]  # d's two images do not fit the room


def test_a_queued_request_of_the_leads_set_that_fits_the_room_begins_first() -> None:
    running = {KEY: [(rec(1, 30, done=1), "a")]}
    fits, too_big, elsewhere = rec(2, 40, at=2.0), rec(4, 40, at=3.0), rec(1, 40, at=4.0, key="other")
    op = choose(candidates(running, [(too_big, "big"), (elsewhere, "elsewhere"), (fits, "fits")], 64), NOW, 4)
    assert op is not None and (op.kind, op.lead.item) == (BEGIN, "fits")
    assert op.runner_up is None and len(op.waiting) == 4
    op = choose(candidates(running, [(too_big, "big"), (elsewhere, "elsewhere")], 64), NOW, 4)
    assert op is not None and (op.kind, op.lead.item) == (TICK, "a")


def test_residency_a_queued_request_begins_when_its_images_fit_or_nothing_is_resident() -> None:
    resident = {KEY: [(rec(3, 10, done=1), "r")]}
    small, large = rec(1, 10), rec(2, 10)
    found = candidates(resident, [(small, "small"), (large, "large")], 4)
    assert [(c.kind, c.item) for c in found] == [(TICK, "r"), (BEGIN, "small")]
    assert [c.item for c in candidates({}, [(rec(8, 10), "huge")], 4)] == ["huge"]


def test_requests_run_whole_or_of_no_known_key_never_begin_as_rows() -> None:
    found = candidates({}, [(rec(key=WHOLE), "whole"), (rec(key=None), "unknown"), (rec(), "rows")], 64)
    assert [c.item for c in found] == ["rows"]


def test_a_finished_or_interrupted_row_offers_its_finish() -> None:
    found = candidates({KEY: [(rec(1, 4, done=4), "done"), (rec(1, 9, done=2, interrupted=True), "stopped"),
                              (rec(1, 9, done=2), "going")]}, [], 64)
    assert [c.kind for c in found] == [FINISH, FINISH, TICK]


def test_bypass_counts_only_against_larger_requests_and_restarts_when_one_runs() -> None:
    lead, larger, equal, smaller = rec(1, 4), rec(4, 50), rec(1, 4, at=1.0), rec(1, 2)
    count_bypass(lead, [lead], [lead, larger, equal, smaller], 3)
    assert (lead.bypassed, larger.bypassed, equal.bypassed, smaller.bypassed) == (0, 3, 0, 0)
    count_bypass(larger, [larger], [lead, larger], 1)
    assert larger.bypassed == 0


def test_a_stream_of_short_requests_takes_at_most_the_bypass_limit_in_a_row() -> None:
    """max_batch 1: the long row leads once every BYPASS_LIMIT operations, first (tier 0), then counts again."""
    long, short = rec(1, 50, done=1, at=0.0), rec(1, 4, done=1, at=1.0)
    leads = []
    for _ in range(2 * (BYPASS_LIMIT + 1)):
        op = choose(candidates({KEY: [(long, "long"), (short, "short")]}, [], 64), NOW, 1)
        assert op is not None
        leads.append(op.lead.item)
        count_bypass(op.lead.record, op.ran, op.waiting, 1)
    assert leads == (["short"] * BYPASS_LIMIT + ["long"]) * 2
    starved = rec(1, 50, done=1, bypassed=BYPASS_LIMIT)
    assert rank(starved, NOW) == (0, math.inf, 0.0)


def test_across_sizes_an_operation_counts_as_its_share_of_the_waiting_requests_work_per_step() -> None:
    """A 64x64 operation beside a 256x256 request counts 1/16 of a bypass (their work per image-step), so a 64x64
    request's 22 operations (begin, 20 ticks, decode) never hand a 256x256 job's 4-image tick the lead: that tick
    costs more than the whole small request. Within one size an operation counts whole (the test above)."""
    small, large = rec(1, 20, key="64x64"), rec(4, 40, done=1, scale=16.0, key="256x256", at=-1.0)
    assert bypass_weight(small, large) == 1 / 16 and bypass_weight(large, small) == 1.0
    leads = []
    while small.steps_left != 0:
        found = candidates({"256x256": [(large, "large")], **({"64x64": [(small, "small")]} if small.begun else {})},
                           [] if small.begun else [(small, "small")], 64)
        op = choose(found, NOW, 4)
        assert op is not None
        leads.append(op.lead.item)
        count_bypass(op.lead.record, op.ran, op.waiting, 1)
        if op.lead.item == "small":
            small.steps_left = 20 if not small.begun else small.steps_left - 1
    assert set(leads) == {"small"} and len(leads) == 21 and large.bypassed == 21 / 16
    assert rank(large, NOW)[0] == 1  # not starved
    large.bypassed = BYPASS_LIMIT - 1  # one bypass left: sixteen 64x64 operations before it goes first
    op = _tick([(rec(1, 8, done=1), "short")], [], max_batch=1)
    op.waiting.append(large)
    assert run_bound(op, [*op.ran, large], NOW)[0] == 16
    count_bypass(op.lead.record, op.ran, op.waiting, 16)
    assert rank(large, NOW)[0] == 0  # now it goes first


def test_equal_requests_never_push_each_other_ahead() -> None:
    a, b = rec(4, 40, done=1, at=0.0), rec(4, 40, at=1.0)
    for _ in range(3 * BYPASS_LIMIT):
        op = choose(candidates({KEY: [(a, "a")]}, [(b, "b")], 64), NOW, 4)
        assert op is not None and op.lead.item == "a"
        count_bypass(op.lead.record, op.ran, op.waiting, 1)
    assert b.bypassed == 0


def test_the_deadline_guard_urgent_requests_go_first_earliest_deadline_first() -> None:
    """100 s estimated for the whole of a 50-step request with 30 s of work ranked before it: due in 150 s it is
    urgent (1.25 x 100 s fits, 1.25 x 130 s does not), due in an hour it is not; urgent ones go by deadline, before
    any smaller request. (Issue 52 point 0: before it, urgency was 2 x its own estimate, work ahead or not.)"""
    assert URGENT_FACTOR == 1.25
    near = rec(1, 50, at=2.0, deadline=NOW + 150.0, estimate_s=100.0, ahead_s=30.0)
    nearer = rec(1, 50, at=3.0, deadline=NOW + 140.0, estimate_s=100.0, ahead_s=30.0)
    far = rec(1, 50, at=1.0, deadline=NOW + 3600.0, estimate_s=100.0, ahead_s=30.0)
    assert urgent(near, NOW) and not urgent(far, NOW)
    assert not urgent(rec(1, 50, done=40, deadline=NOW + 150.0, estimate_s=100.0, ahead_s=30.0), NOW)  # 12/52 left
    assert rank(near, NOW) == (0, NOW + 150.0, 2.0)
    op = choose([queued("short", rec(1, 4)), queued("far", far), queued("near", near), queued("nearer", nearer)],
                NOW, 4)
    assert op is not None and op.lead.item == "nearer" and op.first


def test_without_an_estimate_or_a_deadline_a_request_is_never_urgent() -> None:
    """Nothing measured: nothing to tell a deadline at risk by (a passed one leaves at the boundary: 504)."""
    assert not urgent(rec(deadline=NOW + 0.5, ahead_s=10.0), NOW)
    assert not urgent(rec(deadline=NOW), NOW)
    assert not urgent(rec(estimate_s=10.0, ahead_s=100.0), NOW)


def test_a_large_request_is_not_urgent_for_being_large() -> None:
    """Issue 52 point 0: a 4-image 50-step request due in 1.5 x its own estimate would meet its deadline after a
    small request, so it does not go ahead of it; one due in 1.1 x its estimate (a client's header) cannot be
    saved by going first over others, so it is not urgent either, whatever is ahead."""
    large = rec(4, 50, at=0.0, deadline=NOW + 150.0, estimate_s=100.0)
    small = rec(1, 4, at=1.0, estimate_s=0.5)
    prepare([large, small])
    assert large.ahead_s == 0.5 and small.ahead_s == 0.0
    assert not urgent(large, NOW)
    op = choose([queued("large", large), queued("small", small)], NOW, 4)
    assert op is not None and op.lead.item == "small" and not op.first
    tight = rec(4, 50, at=0.0, deadline=NOW + 110.0, estimate_s=100.0, ahead_s=1000.0)
    assert not urgent(tight, NOW)


def test_a_small_request_that_would_miss_its_deadline_behind_a_large_one_is_urgent() -> None:
    """A 4-image request four steps from its end (24 x 208) ranks before a 1-image 100-step one (102 x 102); its
    11.5 s left would make the other (10 s of its own, due in 20 s) miss its deadline: it turns urgent and leads.
    Without the deadline the order is Smith's rule."""
    large = rec(4, 50, done=46, at=0.0, estimate_s=100.0)
    small = rec(1, 100, at=1.0, deadline=NOW + 20.0, estimate_s=10.0)
    prepare([large, small])
    assert small.ahead_s == 100.0 * 24 / 208 and urgent(small, NOW)
    op = choose([row("large", large), queued("small", small)], NOW, 1)
    assert op is not None and op.lead.item == "small" and op.first
    small.deadline = None
    op = choose([row("large", large), queued("small", small)], NOW, 1)
    assert op is not None and op.lead.item == "large"


def test_an_interrupted_row_goes_first() -> None:
    op = choose([row("short", rec(1, 4, done=1)), row("mine", rec(4, 50, done=3, interrupted=True))], NOW, 4)
    assert op is not None and (op.kind, op.lead.item, op.first) == (FINISH, "mine", True)


def _tick(rows: list[tuple[Record, str]], queue: list[tuple[Record, str]], max_batch: int = 4) -> Decision[str]:
    op = choose(candidates({KEY: rows}, queue, 64), NOW, max_batch)
    assert op is not None and op.kind == TICK
    return op


def test_a_run_is_bounded_by_max_run_with_nothing_else_to_decide() -> None:
    lone = rec(1, 200, done=1)
    assert run_bound(_tick([(lone, "lone")], []), [lone], NOW) == (MAX_RUN, math.inf)


def test_a_run_ends_before_a_waiting_request_reaches_its_bypass_limit() -> None:
    short, long = rec(1, 8, done=1), rec(4, 50, at=-1.0, bypassed=BYPASS_LIMIT - 5)
    op = _tick([(short, "short")], [(long, "long")], max_batch=1)
    assert op.lead.item == "short" and run_bound(op, [short, long], NOW) == (5, math.inf)
    equal = rec(1, 8, at=-1.0, bypassed=9)  # equal whole work: not a bypass, no bound
    assert run_bound(_tick([(short, "short")], [(equal, "equal")], max_batch=1), [short, equal], NOW)[0] == MAX_RUN


def test_a_run_ends_before_a_deadline_and_before_a_waiting_request_turns_urgent() -> None:
    mine = rec(1, 8, done=1, deadline=NOW + 30.0)
    other = rec(4, 50, at=-1.0, deadline=NOW + 500.0, estimate_s=100.0)
    op = _tick([(mine, "mine")], [(other, "other")], max_batch=1)
    _, until = run_bound(op, [mine, other], NOW)
    assert until == NOW + 30.0  # its own deadline: a ran row's urgency does not bound it
    mine.deadline = None
    _, until = run_bound(op, [mine, other], NOW)
    other.ahead_s = 40.0
    _, until = run_bound(op, [mine, other], NOW)
    assert until == NOW + 500.0 - URGENT_FACTOR * 140.0  # when the waiting one turns urgent: all of it left + ahead


def test_a_run_ends_when_a_queued_request_run_whole_is_due_and_runs_one_when_it_is() -> None:
    lone = rec(1, 40, done=1)
    op = _tick([(lone, "lone")], [])
    assert run_bound(op, [lone], NOW, whole_in=1) == (1, math.inf)
    assert run_bound(op, [lone], NOW, whole_in=0) == (1, math.inf)  # at least one
    assert run_bound(op, [lone], NOW, whole_in=3)[0] == 3


def test_a_lead_that_goes_first_runs_one_operation() -> None:
    stopped = rec(1, 30, done=2, interrupted=True)
    op = choose(candidates({KEY: [(stopped, "stopped")]}, [], 64), NOW, 4)
    assert op is not None and op.first and run_bound(op, [stopped], NOW) == (1, NOW)


def test_a_run_ends_with_the_finish_of_the_row_it_completed_when_that_goes_next() -> None:
    a, b = rec(1, 4, done=4, bypassed=3), rec(1, 30, done=5)
    assert finish_next([a, b], NOW, None, 1) == 0 and a.bypassed == 0
    assert finish_next([a], NOW, rank(rec(1, 1), NOW), 1) is None  # a queued 1-step request (3 x 3) goes first
    assert finish_next([a], NOW, rank(rec(1, 40), NOW), 1) == 0
    assert finish_next([rec(1, 30, done=29)], NOW, None, 1) is None  # its denoising is not over
    assert finish_next([rec(1, 30, done=4, interrupted=True)], NOW, None, 1) is None  # the loop's finish
    assert finish_next([rec(4, 4, done=4)], NOW, None, 1) is None  # three parts of its decode left first
    assert finish_next([rec(4, 4, done=4, decoded=3)], NOW, None, 1) == 0
    assert finish_next([rec(4, 4, done=4)], NOW, None, 4) == 0  # one part of four images


def test_requests_run_whole_take_turns_with_the_running_sets() -> None:
    """Round robin: one goes at once, the next once every running set had an operation since."""
    turns = Turns()
    assert turns.due(3)
    turns.took()
    assert not turns.due(2) and turns.left(2) == 2
    turns.ran(1)
    assert not turns.due(2) and turns.left(2) == 1
    turns.ran(1)
    assert turns.due(2) and turns.left(2) == 0
    turns.took()
    assert turns.due(0)  # no running set: nothing to wait for
