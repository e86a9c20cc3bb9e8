"""Profile drift refused at boot (issue 53, point 2): a model folder whose ``trt/manifest.json`` records engines
built for 1..4 images at 64x64 (the records the real build plan of the tiny model gives, engines/build/trtplan.py;
the engines themselves are absent: the check runs before any is opened), booted under a production-like profile
written by the test, whose configuration asks for more rows, another size, or holds no record.

On this CPU a TensorRT policy is refused in preflight first (exit 20, tests/integration/test_exit_codes.py), so
the boot here is the real one minus preflight: the settings from the profile TOML through server/bootstrap.py, the
engine from engines/factory.py, ``load()`` verifying the model folder and then the engines' profiles
(engines/artifact_checks.py), and the exit code from server/exitcodes.py's table. ``sdserve doctor`` goes on to
load after a failed preflight, so a real process shows the same refusal beside its exit 20.

An input outside a profile given explicitly fails at run time instead of rebuilding the engine
(onnxruntime/core/providers/tensorrt/tensorrt_execution_provider.cc, PR #18217): hence the refusal at boot."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from engines.artifacts import write_engine_manifest
from engines.build import trtplan
from engines.errors import ArtifactError, GpuUnavailableError, NotReadyError
from engines.health.trt_coverage import RECORD
from server.bootstrap import BootConfig
from server.exitcodes import ExitCode, exit_code_for
from server.settings import CONFIG_DIR
from tests.integration.test_exit_codes import assert_exit, sdserve


def _model(tiny_model: Path, dest: Path, record: bool = True) -> Path:
    """A copy of the tiny model with an engine manifest for 64x64 at 1..4 images (what `engines build` writes)."""
    model = dest / "model"
    shutil.copytree(tiny_model, model)
    plan = trtplan.plan(model, trtplan.profiles_from([(64, 64)], batch_max=4, batch_opt=4), trtplan.BuildFlags())
    entry = plan["sizes"]["64x64"]
    size = {"profile": entry["profile"], "context_models": {c: f"64x64/{c}_ctx.onnx" for c in entry["components"]},
            **({RECORD: entry[RECORD]} if record else {})}
    (model / "trt").mkdir()
    write_engine_manifest(model / "trt", {}, {"64x64": size}, plan["build_flags"], {})
    return model


def _profile(tmp_path: Path, **replace: str) -> Path:
    """configs/production.toml (TensorRT then CUDA, engines required) serving 64x64, with lines replaced."""
    text = (CONFIG_DIR / "production.toml").read_text().replace('sizes = ["512x512"]', 'sizes = ["64x64"]')
    for old, new in replace.items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "prod.toml"
    path.write_text(text)
    return path


def _boot(model: Path, profile: Path) -> NotReadyError:
    """What ``load()`` raises under the profile (preflight skipped: it refuses first on this CPU)."""
    boot = BootConfig.create(model, config=profile)
    engine = boot.engine()
    with pytest.raises(NotReadyError) as caught:
        engine.load()
    engine.close()
    return caught.value


@pytest.mark.parametrize(("line", "raised", "images"), [
    ("max_batch = 4", "max_batch = 8", 8),
    ("max_n = 4", "max_n = 6", 6),
])
def test_more_rows_than_the_engines_were_built_for_refuses_the_boot_23(tiny_model: Path, tmp_path: Path, line: str,
                                                                     raised: str, images: int) -> None:
    model = _model(tiny_model, tmp_path)
    error = _boot(model, _profile(tmp_path, **{line: raised}))
    assert isinstance(error, ArtifactError) and exit_code_for(error) == ExitCode.ARTIFACT_INVALID
    message = str(error)
    assert f"max(queue.max_batch, limits.max_n, serving.batch_sizes) = {images}" in message
    assert (f"unet at 64x64: {images} images per call need {2 * images} rows, the engine's profile takes at most 8 "
            "(4 images, max shapes encoder_hidden_states:8x77x32,sample:8x4x8x8,timestep:8)") in message
    assert f"text_encoder at 64x64: {images} images per call need {2 * images} rows" in message
    assert f"vae_decoder at 64x64: {images} images per call need {images} rows" in message
    assert f"`sdserve engines build --model {model} --profile production`" in message


def test_a_real_doctor_process_names_the_drift_beside_its_preflight_exit(tiny_model: Path, tmp_path: Path) -> None:
    """`sdserve doctor` keeps going after a failed preflight: its report carries the load's refusal too."""
    model = _model(tiny_model, tmp_path)
    done = sdserve("doctor", "--config", str(_profile(tmp_path, **{"max_batch = 4": "max_batch = 8"})), "--model",
                   str(model))
    assert_exit(done, ExitCode.GPU_UNAVAILABLE, "unet at 64x64: 8 images per call need 16 rows")


def test_a_size_added_after_the_build_refuses_the_boot_23(tiny_model: Path, tmp_path: Path) -> None:
    model = _model(tiny_model, tmp_path)
    error = _boot(model, _profile(tmp_path, **{'sizes = ["64x64"]': 'sizes = ["64x64", "128x64"]'}))
    assert isinstance(error, ArtifactError) and exit_code_for(error) == ExitCode.ARTIFACT_INVALID
    assert "128x64: no engine for this served size (built: 64x64)" in str(error)
    assert "unet at 64x64" not in str(error)  # 64x64 itself is covered


def test_engines_without_a_profile_record_are_refused_23(tiny_model: Path, tmp_path: Path) -> None:
    error = _boot(_model(tiny_model, tmp_path, record=False), _profile(tmp_path))
    assert isinstance(error, ArtifactError) and exit_code_for(error) == ExitCode.ARTIFACT_INVALID
    assert "unet at 64x64: no recorded optimization profile" in str(error)
    assert "sdserve engines build --model" in str(error)


def test_a_covered_configuration_passes_on_to_the_node_check(tiny_model: Path, tmp_path: Path) -> None:
    """The configuration the engines were built for: the profile check passes and the next check (the engines'
    node, by NVML index) is what refuses on this CPU."""
    error = _boot(_model(tiny_model, tmp_path), _profile(tmp_path))
    assert isinstance(error, GpuUnavailableError), error
    assert "matches no NVML device" in str(error)
