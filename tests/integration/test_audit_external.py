"""The placement audit on models whose weights are external data, as every real-size model's are, with real ORT.

Two faults this guards (issue 37): a LoRA variant is built from bytes whose initializers point at external files,
and the audit's second session on those bytes needs ``session.model_external_initializers_file_folder_path`` too
(onnxruntime/core/framework/tensorprotoutils.cc ``ValidateExternalDataPathFromDir``: "External data path for model
loaded from bytes escapes working directory"); and the audit's dump of the partitioned graph must not write the
model's weights to the temporary folder (``session.optimized_model_external_initializers_min_size_in_bytes``
sends every larger initializer to the dump's weight file, which here links to the null device).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import onnx
import onnxruntime as ort
import pytest

from engines.lora import targets
from engines.runtime import placement
from engines.runtime.dataflow import CPU_PROVIDER, partitioned_graph


@pytest.fixture(scope="module")
def external_unet(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny UNet saved with every initializer over 1 KB as external data (one file beside the model)."""
    folder = tmp_path_factory.mktemp("external") / "unet"
    folder.mkdir()
    model = onnx.load(str(tiny_model / "unet" / "model.onnx"))
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, location="model.onnx_data",
              size_threshold=1024)
    assert (folder / "model.onnx_data").stat().st_size > 10 * (folder / "model.onnx").stat().st_size
    return folder / "model.onnx"


def _variant(path: Path) -> bytes:
    """A LoRA variant as engines/lora/manager.py builds one for an external-data model: the graph without weights,
    every adaptable weight overridable."""
    model = onnx.load(str(path), load_external_data=False)
    found = targets.find(onnx.load(str(path)))
    assert found
    return targets.with_overridable(model, found)


def _cpu_session(model: bytes | Path, folder: Path | None) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.add_session_config_entry(placement.CONFIG_KEY, "1")
    if folder is not None:
        so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    return ort.InferenceSession(model if isinstance(model, bytes) else str(model), so, providers=[CPU_PROVIDER])


def _written_under(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def test_a_lora_variant_of_an_external_data_model_is_classified(external_unet: Path) -> None:
    """The audit with classification runs on the variant (every CPU node named in the partitioned graph); before,
    the dump raised and the component was refused (exit 22) on every real-size model with a LoRA library."""
    variant = _variant(external_unet)
    sess = _cpu_session(variant, external_unet.parent)
    report = placement.audit(sess, "unet:lora", variant, classify=True, external_folder=external_unet.parent)
    assert report.unclassified in (None, ""), report.unclassified
    assert report.cpu_nodes and not report.unmatched
    assert report.shape_path and report.activation_on_cpu  # a CPU session: shape ops allowed, compute named
    without = placement.audit(sess, "unet:lora", variant, classify=True)
    assert "escapes working directory" in (without.unclassified or "") or "External data" in (
        without.unclassified or ""), without.unclassified


def test_the_dump_writes_the_graph_not_the_weights(external_unet: Path, tmp_path: Path) -> None:
    weights = (external_unet.parent / "model.onnx_data").stat().st_size
    work = tmp_path / "work"
    work.mkdir()
    seen: list[int] = []
    real = tempfile.TemporaryDirectory.__exit__

    def measure(self: tempfile.TemporaryDirectory[str], *args: object) -> None:
        seen.append(_written_under(Path(self.name)))
        real(self, *args)

    tempfile.TemporaryDirectory.__exit__ = measure  # type: ignore[method-assign]
    try:
        graph = partitioned_graph(external_unet, workdir=work)
        graph_bytes = partitioned_graph(_variant(external_unet), workdir=work, external_folder=external_unet.parent)
    finally:
        tempfile.TemporaryDirectory.__exit__ = real  # type: ignore[method-assign]
    assert len(graph.node) == len(graph_bytes.node) > 100
    assert seen and max(seen) < weights / 4, (seen, weights)
    assert not os.listdir(work)


def test_a_relocated_external_data_model_still_audits(external_unet: Path, tmp_path: Path) -> None:
    """The external folder is the one the session was told, not the process's working directory."""
    moved = tmp_path / "moved"
    shutil.copytree(external_unet.parent, moved)
    variant = _variant(moved / "model.onnx")
    report = placement.audit(_cpu_session(variant, moved), "unet:lora", variant, classify=True,
                             external_folder=moved)
    assert report.unclassified in (None, "") and not report.unmatched
