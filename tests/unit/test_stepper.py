"""The step scheduler's policy (server/stepper.py) on the real app, behind the engine protocol: who joins at which
tick, the row budget, the order across sets, deadlines, interrupts and departures at tick boundaries. Every wait is
on an event or a state (a held tick, /sdapi/v1/progress), never on a sleep. The images themselves are the
integration tests' (tests/integration/test_step_batching.py)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Hashable, Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from starlette.concurrency import run_in_threadpool

from engines.errors import InferenceError
from engines.protocol import StepRun
from engines.types.request import Batch, BatchResult, ImageSpec, StepHook
from server import stepper
from server.batcher import Batcher
from server.errors import DeadlineExceededError
from server.metrics import Metrics
from server.settings import Settings, load_settings
from server.stepper import StepBatcher
from tests.unit.fakes import FakeRun, StepFakeEngine, start
from tests.unit.fakes import wait_for as _wait

PROGRESS = "/sdapi/v1/progress"


@pytest.fixture
def engine() -> Iterator[StepFakeEngine]:
    fake = StepFakeEngine()
    yield fake
    fake.hold.set()  # a failed test never leaves the server's tick held
    if fake.gate is not None:
        fake.gate.release(100)


def _begun(engine: StepFakeEngine, count: int) -> list[FakeRun]:
    """Wait (bounded) until ``count`` runs have begun."""
    done = threading.Event()

    def check() -> None:
        while not done.is_set() and len(engine.runs) < count:
            done.wait(0.01)
        done.set()

    threading.Thread(target=check, daemon=True).start()
    assert done.wait(20) and len(engine.runs) >= count
    return engine.runs


@pytest.fixture
def client(engine: StepFakeEngine) -> Iterator[TestClient]:
    yield from start(engine, load_settings("dev"))


def _post(client: TestClient, body: dict[str, Any], out: list[Any], headers: dict[str, str] | None = None) -> \
        threading.Thread:
    worker = threading.Thread(target=lambda: out.append(client.post("/sdapi/v1/txt2img", json=body,
                                                                    headers=headers or {})))
    worker.start()
    return worker


def _queued(client: TestClient, jobs: int) -> None:
    _wait(client, PROGRESS, lambda r: r.json()["state"]["job_count"] == jobs)


def test_a_short_request_runs_at_the_next_boundary_and_leaves_first(client: TestClient,
                                                                    engine: StepFakeEngine) -> None:
    """A 4-step request arriving while a 4-image 30-step one runs (the whole 4-image budget of a call) takes the
    next four ticks, then the long one resumes; nothing waits for a whole generation."""
    engine.hold.clear()
    long: list[Any] = []
    short: list[Any] = []
    first = _post(client, {"prompt": "long", "steps": 30, "batch_size": 4}, long)
    _begun(engine, 1)
    second = _post(client, {"prompt": "short", "steps": 4}, short)
    _queued(client, 2)  # the long one holds its first tick; the short one is queued behind it
    engine.hold.set()
    second.join(20)
    first.join(20)
    assert short[0].status_code == 200 and long[0].status_code == 200
    log = engine.tick_log
    joined = log.index(["short"])
    assert joined >= 1 and all(t == ["long"] for t in log[:joined])  # the long one ran alone until the boundary
    assert log[joined:joined + 4] == [["short"]] * 4  # at once, four ticks of its own
    assert len(log) == 34 and all(t == ["long"] for t in log[joined + 4:])  # then the long one again
    info = json.loads(short[0].json()["info"])
    assert info["steps_done"] == 4 and info["interrupted"] is False
    assert "first-step;dur=" in short[0].headers["server-timing"]


def test_calls_are_filled_to_the_budget_the_least_work_first(client: TestClient,
                                                          engine: StepFakeEngine) -> None:
    """Requests with different step counts, samplers, guidance and seeds of one size share every call the budget
    allows (dev: 4 images); the one with the least work leads."""
    engine.hold.clear()
    results: list[Any] = []
    workers = [_post(client, {"prompt": "a", "steps": 30, "sampler_name": "Euler a"}, results)]
    _begun(engine, 1)
    workers += [_post(client, {"prompt": "b", "steps": 10, "seed": 7, "sampler_name": "DPM++ 2M"}, results),
                _post(client, {"prompt": "c", "steps": 4, "cfg_scale": 1.0}, results)]
    _queued(client, 3)
    engine.hold.set()
    for worker in workers:
        worker.join(20)
    assert [r.status_code for r in results] == [200] * 3
    log = engine.tick_log
    assert log[1:5] == [["c", "b", "a"]] * 4  # one call for the three, the least work first
    assert log[5:11] == [["b", "a"]] * 6 and log[11:] == [["a"]] * 19  # then b's last six, then a alone


def test_the_tick_budget_holds_and_the_least_work_leads_across_sizes(client: TestClient,
                                                                      engine: StepFakeEngine) -> None:
    """dev: max_batch 4. A 4-image request fills a tick, so a same-size 6-step request runs in ticks of its own
    (it leads: 1 x (6 + 2) evaluations left against 4 x (6 + 2)); a 3-step request at 128x128 starts a set of its
    own and goes before the 4-image one too (1 x (3 + 2) evaluations at four times the pixels)."""
    engine.hold.clear()
    results: dict[str, list[Any]] = {"full": [], "same": [], "other": []}
    workers = [_post(client, {"prompt": "full", "steps": 6, "batch_size": 4}, results["full"])]
    _begun(engine, 1)
    workers.append(_post(client, {"prompt": "same", "steps": 6}, results["same"]))
    workers.append(_post(client, {"prompt": "other", "steps": 3, "width": 128, "height": 128}, results["other"]))
    _queued(client, 3)
    engine.hold.set()
    for worker in workers:
        worker.join(20)
    assert all(r[0].status_code == 200 for r in results.values())
    log = engine.tick_log
    assert all(len(t) == 1 for t in log)  # 4 + 1 images never share a 4-image call
    full_ticks = [i for i, t in enumerate(log) if "full" in t]
    other_ticks = [i for i, t in enumerate(log) if "other" in t]
    assert len(full_ticks) == 6 and len(other_ticks) == 3
    assert max(other_ticks) < min(full_ticks[1:])  # after the held tick, it did not wait for the larger work
    assert [r.ticks for r in engine.runs if r.batch.width == 128] == [[1, 1, 1]]


def test_a_row_past_its_deadline_leaves_at_the_boundary_and_frees_its_slot(client: TestClient,
                                                                           engine: StepFakeEngine) -> None:
    engine.hold.clear()
    engine.ticked.clear()
    late: list[Any] = []
    worker = _post(client, {"prompt": "late", "steps": 50}, late, {"x-sdserve-timeout-s": "2"})
    runs = _begun(engine, 1)
    deadline = threading.Event()
    threading.Timer(2.2, deadline.set).start()  # the deadline itself is time: wait until it has passed
    assert deadline.wait(10)
    engine.hold.set()
    worker.join(20)
    assert late[0].status_code == 504 and "left the running batch" in late[0].text
    assert runs[0].released and runs[0].steps_done < 50
    _queued(client, 0)


def test_an_interrupt_decodes_the_row_where_it_is_and_spares_the_others(client: TestClient,
                                                                         engine: StepFakeEngine) -> None:
    engine.hold.clear()
    results: list[Any] = []
    worker = _post(client, {"prompt": "mine", "steps": 40}, results)
    _begun(engine, 1)
    stopped = client.post("/sdapi/v1/interrupt").json()
    assert (stopped["running"], stopped["queued"]) == (1, 0)
    engine.hold.set()
    worker.join(20)
    info = json.loads(results[0].json()["info"])
    assert results[0].status_code == 200 and info["interrupted"] is True and 1 <= info["steps_done"] < 40
    assert results[0].headers["x-sdserve-interrupted"] == f"{info['steps_done']}/40"


def test_progress_reports_the_running_request_step(client: TestClient, engine: StepFakeEngine) -> None:
    gate = engine.gate = threading.Semaphore(1)  # the first tick passes, the second waits
    results: list[Any] = []
    worker = _post(client, {"prompt": "a", "steps": 8}, results)
    busy = _wait(client, PROGRESS, lambda r: r.json()["state"]["sampling_step"] >= 1)
    assert busy["state"]["sampling_step"] == 1 and busy["state"]["sampling_steps"] == 8
    assert busy["state"]["job"] == "sdserve: generating"
    engine.gate = None
    gate.release(8)
    worker.join(20)
    assert results[0].status_code == 200


def test_micro_batching_stays_a_setting_and_runs_each_batch_to_the_end(engine: StepFakeEngine) -> None:
    """queue.batching = "micro": the micro-batcher, which runs batches whole (generate), no ticks."""
    settings = load_settings("dev")
    micro = Settings.model_validate({**settings.model_dump(), "queue": {**settings.queue.model_dump(),
                                                                         "batching": "micro"}})
    for client in start(engine, micro):
        assert type(client.app.state.service.batcher) is Batcher  # type: ignore[attr-defined]
        response = client.post("/sdapi/v1/txt2img", json={"prompt": "a", "steps": 3})
        assert response.status_code == 200 and not engine.tick_log and engine.batches


def _batcher(engine: StepFakeEngine) -> StepBatcher:
    return StepBatcher(engine, Metrics(), asyncio.Lock(), 32, 4, 0.0)


def test_a_row_whose_client_went_away_is_released_at_the_next_boundary(engine: StepFakeEngine) -> None:
    engine.loaded = True

    async def scenario() -> FakeRun:
        batcher = _batcher(engine)
        loop = asyncio.get_running_loop()
        runner = loop.create_task(batcher.run())
        engine.hold.clear()
        waiting = loop.create_task(batcher.submit(Batch((ImageSpec("gone"),), steps=50), None))
        while not engine.runs:  # begun: its first tick is held
            await asyncio.sleep(0)
        waiting.cancel()  # the client disconnects
        engine.hold.set()
        while not engine.runs[0].released:
            await asyncio.sleep(0)
        run = engine.runs[0]
        while batcher.busy:
            await asyncio.sleep(0)
        runner.cancel()
        return run

    run = asyncio.run(asyncio.wait_for(scenario(), 20))
    assert run.released and run.steps_done < 50 and not engine.batches  # never decoded


def test_a_deadline_passed_in_the_queue_is_a_504_before_it_begins(engine: StepFakeEngine) -> None:
    engine.loaded = True

    async def scenario() -> None:
        batcher = _batcher(engine)
        with pytest.raises(DeadlineExceededError):
            await batcher.submit(Batch((ImageSpec("x"),), steps=5), deadline=0.0)

    asyncio.run(scenario())
    assert not engine.runs


async def _release_after(engine: StepFakeEngine, batcher: StepBatcher, first: Batch, later: list[Batch],
                         deadlines: dict[str, float] | None = None, at_decode: bool = False) -> None:
    """``first`` begins and its first tick (``at_decode``: the first part of its decode) is held; every batch of
    ``later`` is queued; then the operations run until every request is answered."""
    loop = asyncio.get_running_loop()
    runner = loop.create_task(batcher.run())
    hold, entered = (engine.decode_hold, engine.in_decode) if at_decode else (engine.hold, engine.in_tick)
    hold.clear()
    entered.clear()
    due = deadlines or {}
    tasks = [loop.create_task(batcher.submit(first, due.get(first.images[0].prompt)))]
    while not entered.is_set():  # the operation is in flight (held)
        await asyncio.sleep(0)
    tasks += [loop.create_task(batcher.submit(b, due.get(b.images[0].prompt))) for b in later]
    while len(batcher.queue) < len(later):
        await asyncio.sleep(0)
    hold.set()
    await asyncio.gather(*tasks)
    runner.cancel()


def _one(prompt: str, steps: int, images: int = 1) -> Batch:
    return Batch(tuple(ImageSpec(prompt, seed=k) for k in range(images)), steps=steps)


def test_a_stream_of_short_requests_delays_a_long_one_but_never_stops_it(engine: StepFakeEngine) -> None:
    """max_batch 1, so the long row cannot ride in the short ones' calls: twenty 4-step requests queued behind a
    50-step one go first, but never more than BYPASS_LIMIT operations in a row; then the long one's goes first."""
    from server.step_policy import BYPASS_LIMIT

    engine.loaded = True
    batcher = StepBatcher(engine, Metrics(), asyncio.Lock(), 64, 1, 0.0)
    shorts = [_one(f"s{k}", 4) for k in range(20)]
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("long", 50), shorts), 30))
    ops = engine.ops
    mine = [i for i, (_, lead) in enumerate(ops) if lead == "long"]
    last_short = max(i for i, (_, lead) in enumerate(ops) if lead.startswith("s"))
    gaps = [b - a - 1 for a, b in zip(mine, mine[1:], strict=False) if b < last_short]
    assert ops[2] == ("begin", "s0") and max(gaps) == BYPASS_LIMIT, (gaps, ops[:40])  # after its held tick
    assert sum(1 for i in mine if i < last_short) >= 4  # it advanced while short requests were still waiting
    assert all(len(t) == 1 for t in engine.tick_log)


def test_a_long_request_decodes_after_a_short_one_that_arrived_during_its_last_tick(engine: StepFakeEngine) -> None:
    """A 4-image 1-step request finishes its tick while a 1-image 4-step one waits: the short one is begun,
    ticked and decoded (rank 6 x 6 against the long one's decode, 8 x 12) before the long one's decode, which then
    runs one image at a time (dev: decode_images 1)."""
    engine.loaded = True
    batcher = _batcher(engine)
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("long", 1, images=4), [_one("short", 4)]), 30))
    assert engine.ops == [("begin", "long"), ("tick", "long"), ("begin", "short"), *[("tick", "short")] * 4,
                          ("finish", "short"), *[("decode", "long")] * 3, ("finish", "long")]


def test_a_short_request_arriving_during_a_decode_waits_for_one_part_of_it(engine: StepFakeEngine) -> None:
    """dev: decode_images 1. A 4-image request's decode runs one image at a time: a short request that arrives
    while the first image decodes goes next, before the other three (its decode is split too, after its ticks)."""
    engine.loaded = True
    batcher = _batcher(engine)
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("long", 1, images=4), [_one("short", 4)],
                                                at_decode=True), 30))
    assert engine.ops == [("begin", "long"), ("tick", "long"), ("decode", "long"), ("begin", "short"),
                          *[("tick", "short")] * 4, ("finish", "short"), *[("decode", "long")] * 2, ("finish", "long")]


def test_a_finished_row_is_decoded_before_longer_work_begins(engine: StepFakeEngine) -> None:
    """A 1-image request whose last step ran (its decode left: rank 2 x 3) is answered before a queued 1-image
    30-step request (32 x 32) begins."""
    engine.loaded = True
    batcher = _batcher(engine)
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("done", 1), [_one("next", 30)]), 30))
    assert engine.ops[:4] == [("begin", "done"), ("tick", "done"), ("finish", "done"), ("begin", "next")]


def test_a_request_near_its_deadline_goes_before_smaller_ones(engine: StepFakeEngine) -> None:
    """The deadline guard: with 100 s per image-step measured, a 50-step request (5000 s) due in 6255 s meets its
    deadline going first (1.25 x 5000 s) but not behind the 4-step request ranked before it (1.25 x (5000 s + its
    333 s)), so it is urgent and leads every operation before that request, which has no deadline (and rides in its
    calls: room is left). Issue 52 point 0: before, due in an hour (less than 2 x its own 5000 s) made it urgent."""
    import time

    from server.admission import CostModel

    class Measured(CostModel):
        def observe_step(self, width: int, height: int, images: int, seconds: float) -> None:
            """The fake's ticks take microseconds: the premise here is the 100 s per image-step measured."""

    engine.loaded = True
    batcher = StepBatcher(engine, Metrics(), asyncio.Lock(), 32, 4, 0.0, cost=Measured())
    batcher.cost.seed(64, 64, 1, 1, 100.0)
    due = {"urgent": time.monotonic() + 6255.0}
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("short", 4), [_one("urgent", 50)], due), 30))
    assert engine.ops[:3] == [("begin", "short"), ("tick", "short"), ("begin", "urgent")]
    assert engine.tick_log[1:4] == [["urgent", "short"]] * 3  # it leads; the short row's last three fill its calls


def test_a_lone_request_runs_its_ticks_and_its_decode_in_one_engine_call_each(engine: StepFakeEngine,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Nothing to decide between them: the ticks of the same rows run back to back in the engine's thread (one
    hop, not one per step), and so do the parts of the decode, the finish included when it goes next; the
    operations are the ones the loop would have chosen one by one. A 1-image request: its ticks and its finish."""
    engine.loaded = True
    batcher = _batcher(engine)
    hops: list[str] = []

    async def counting(func: Any, *args: Any) -> Any:
        hops.append(func.__name__)
        return await run_in_threadpool(func, *args)

    monkeypatch.setattr(stepper, "run_in_threadpool", counting)

    async def scenario() -> None:
        runner = asyncio.get_running_loop().create_task(batcher.run())
        await batcher.submit(_one("lone", 8, images=4), None)
        await batcher.submit(_one("one", 3), None)
        runner.cancel()

    asyncio.run(asyncio.wait_for(scenario(), 30))
    assert engine.ops == [("begin", "lone"), *[("tick", "lone")] * 8, *[("decode", "lone")] * 3, ("finish", "lone"),
                          ("begin", "one"), *[("tick", "one")] * 3, ("finish", "one")]
    assert hops == ["begin", "_ticks", "_decodes", "begin", "_ticks"]


def test_equal_requests_finish_in_order_without_pushing_each_other_ahead(engine: StepFakeEngine) -> None:
    """Three equal 4-image 40-step requests (each fills max_batch 4): the first runs all its steps and its decode
    before the second begins, and so on; equal requests never count as bypassing each other, so none is promoted
    after BYPASS_LIMIT operations (which would put a starved long request before a short one arriving then)."""
    engine.loaded = True
    batcher = _batcher(engine)
    later = [_one("b", 40, images=4), _one("c", 40, images=4)]
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("a", 40, images=4), later), 30))
    expected = [op for name in "abc" for op in [("begin", name), *[("tick", name)] * 40, *[("decode", name)] * 3,
                                                 ("finish", name)]]
    assert engine.ops == expected


class _FailingFinish(StepFakeEngine):
    def finish(self, run: StepRun, stopped: bool = False) -> BatchResult:
        assert isinstance(run, FakeRun)
        if run.batch.images[0].prompt == "boom":
            run.released = True
            raise InferenceError("the decode failed")
        return super().finish(run, stopped)


def test_a_finish_that_fails_in_a_run_answers_its_request_and_the_loop_goes_on() -> None:
    """A 1-image request's finish runs at the end of its run of ticks, in the engine's thread: when it fails, that
    request gets the failure, its slot is freed, and the next request is served."""
    engine = _FailingFinish()
    engine.loaded = True
    batcher = _batcher(engine)

    async def scenario() -> BatchResult:
        runner = asyncio.get_running_loop().create_task(batcher.run())
        with pytest.raises(InferenceError, match="the decode failed"):
            await batcher.submit(_one("boom", 3), None)
        result = await batcher.submit(_one("fine", 3), None)
        runner.cancel()
        return result

    result = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert result.steps_done == 3 and batcher.running == 0 and not batcher.sets
    assert engine.ops == [("begin", "boom"), *[("tick", "boom")] * 3, ("begin", "fine"), *[("tick", "fine")] * 3,
                          ("finish", "fine")]


class _SomeWhole(StepFakeEngine):
    """Requests whose prompt starts with "whole" run whole (a pipeline without stages: step_key None)."""

    def step_key(self, batch: Batch) -> Hashable | None:
        return None if batch.images[0].prompt.startswith("whole") else super().step_key(batch)

    def generate(self, batch: Batch, on_step: StepHook | None = None) -> BatchResult:
        self.ops.append(("whole", batch.images[0].prompt))
        return super().generate(batch, on_step)


def test_a_request_run_whole_waits_for_one_operation_per_running_set_not_for_a_run() -> None:
    """A request the engine runs whole goes once every running set had an operation since the last one: two are
    queued while a 30-step request's tick is held; the first runs, then the second after one tick of the running
    set, not after the rest of its ticks (a run of ticks is bounded by it)."""
    engine = _SomeWhole()
    engine.loaded = True
    batcher = _batcher(engine)
    later = [_one("whole one", 3), _one("whole two", 5)]
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, _one("long", 30), later), 30))
    assert engine.ops[:5] == [("begin", "long"), ("tick", "long"), ("whole", "whole one"), ("tick", "long"),
                              ("whole", "whole two")]


def test_admission_prices_the_wait_by_the_policys_order_not_the_whole_queue(engine: StepFakeEngine) -> None:
    """Issue 52 point 0: three 4-image 50-step requests queued (20 s each at 0.1 s per image-step): a 1-image
    20-step request (2 s) ranks before them, so it waits for none and is admitted with a 10 s deadline; a fourth
    large one waits for all three (the whole queue, as the micro-batcher prices it)."""
    import time

    import server.admission as admission
    from server.admission import Cost
    from server.batcher import Job

    async def scenario() -> tuple[float, float, float]:
        batcher = _batcher(engine)
        batcher.cost.seed(64, 64, 1, 10, 1.0)
        loop = asyncio.get_running_loop()
        for k in range(3):
            batcher.queue.append(Job(_one(f"large{k}", 50, 4), loop.create_future(), time.monotonic(), None))
        small, large = [Cost(64, 64, 20, 1)], [Cost(64, 64, 50, 4)]
        admission.admit(batcher.cost, small, batcher.ahead_seconds(small), 10.0, "x-sdserve-timeout-s")
        return batcher.ahead_seconds(small), batcher.ahead_seconds(large), batcher.ahead_seconds()

    small_wait, large_wait, whole_queue = asyncio.run(scenario())
    assert small_wait == 0.0
    assert abs(large_wait - 60.0) < 1e-9 and abs(whole_queue - 60.0) < 1e-9


def test_the_cost_model_learns_a_sizes_step_cost_from_each_tick_before_the_request_finishes(
        engine: StepFakeEngine) -> None:
    """Each tick's seconds reach the cost model as that size's step cost (CostModel.observe_step, one call per
    tick, its rows' images), before the finished request's own observation: a size's first request is priced from
    its own ticks, not from another size's boot-seeded cost scaled by work for its whole run (which made 256x256
    jobs urgent under the deadline guard on a guess, test_cross_shape's CI failure)."""
    from server.admission import Cost, CostModel

    calls: list[tuple[str, int, int, int]] = []

    class Recording(CostModel):
        def observe_step(self, width: int, height: int, images: int, seconds: float) -> None:
            assert seconds > 0
            calls.append(("step", width, height, images))
            super().observe_step(width, height, images, seconds)

        def observe(self, cost: Any, seconds: float, timings: Any = None) -> None:
            calls.append(("done", cost.width, cost.height, cost.images))
            super().observe(cost, seconds, timings)

    engine.loaded = True
    batcher = StepBatcher(engine, Metrics(), asyncio.Lock(), 64, 4, 0.0, cost=Recording())
    big = Batch(tuple(ImageSpec("big", seed=k) for k in range(2)), steps=3, width=128, height=128)
    asyncio.run(asyncio.wait_for(_release_after(engine, batcher, big, []), 30))
    assert calls == [("step", 128, 128, 2)] * 3 + [("done", 128, 128, 2)], calls
    priced = batcher.cost.estimate(Cost(128, 128, 10, 1))
    assert priced is not None and priced.basis == "measured at 128x128"


def test_no_more_images_than_max_running_are_resident_at_once(engine: StepFakeEngine) -> None:
    """[queue] max_running bounds the images denoising at once (their state on the device). max_running 2,
    max_batch 1, ticks let through one at a time: a long request runs, a 6-step one begins beside it (it ranks
    first by least work), then a 2-step one arrives and ranks before both; it may begin only once a row has left,
    so at most 2 are resident. Counted from the engine's begin/finish order."""
    dev = load_settings("dev")
    settings = dev.model_copy(update={"queue": dev.queue.model_copy(update={"max_running": 2, "max_batch": 1})})
    for client in start(engine, settings):
        gate = engine.gate = threading.Semaphore(0)
        results: list[Any] = []
        workers = [_post(client, {"prompt": "long", "steps": 12}, results)]
        _begun(engine, 1)
        assert engine.in_tick.wait(20)
        workers.append(_post(client, {"prompt": "six", "steps": 6}, results))
        _queued(client, 2)
        engine.in_tick.clear()
        gate.release()  # long's first tick ends; "six" begins and its first tick waits at the gate
        _begun(engine, 2)
        assert engine.in_tick.wait(20)
        workers.append(_post(client, {"prompt": "two", "steps": 2}, results))
        _queued(client, 3)
        engine.gate = None
        gate.release(100)
        for worker in workers:
            worker.join(30)
        assert [r.status_code for r in results] == [200] * 3
        resident, most = 0, 0
        for kind, _ in engine.ops:
            resident += {"begin": 1, "finish": -1}.get(kind, 0)
            most = max(most, resident)
        assert most == 2 and ("begin", "two") in engine.ops, engine.ops
