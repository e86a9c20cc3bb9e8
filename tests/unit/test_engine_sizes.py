"""One engine per served size (ORT 1.31's TensorRT provider keeps its execution context on profile 0): the engine
picks the pipeline built for the batch's size, and a size without a prebuilt engine is a 400 naming the served ones;
without per-size engines one pipeline serves every size."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import pytest

from engines.config import RuntimeSettings
from engines.engine import ANY, OrtEngine
from engines.errors import InvalidRequestError, NotReadyError
from engines.types.request import Batch, ImageSpec


def _batch(width: int, height: int) -> Batch:
    return Batch((ImageSpec("a"),), width, height, 2)


def _engine(pipelines: dict[str, Any]) -> OrtEngine:
    engine = OrtEngine(Path("unused"), RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True))
    engine._pipelines = cast(Any, pipelines)  # what load() builds from the engine manifest's sizes
    return engine


def test_each_size_runs_on_its_own_engine() -> None:
    small, large = object(), object()
    engine = _engine({"512x512": small, "768x512": large})
    assert engine._pipeline_for(_batch(512, 512)) is small
    assert engine._pipeline_for(_batch(768, 512)) is large
    with pytest.raises(InvalidRequestError, match="size 640x640 has no prebuilt engine artifact "
                       r"\(EP-context model\) for CPUExecutionProvider on this server.*512x512, 768x512"):
        engine._pipeline_for(_batch(640, 640))


def test_without_per_size_engines_one_pipeline_serves_every_size() -> None:
    only = object()
    engine = _engine({ANY: only})
    assert engine._pipeline_for(_batch(640, 384)) is only and engine.pipeline is only


def test_nothing_loaded_is_not_ready() -> None:
    with pytest.raises(NotReadyError):
        _engine({})._pipeline_for(_batch(64, 64))
