"""LoRA per request on real ONNX Runtime sessions of the tiny models, against diffusers' own LoRA path.

diffusers' ``load_lora_weights`` + ``fuse_lora(lora_scale=s)`` (peft underneath) is the reference: the same
random factors, saved once as a PEFT/diffusers file and once under kohya names with an alpha, must give our
text-encoder/UNet outputs and seeded images within 1/255 of it, on SD 1.x, SDXL (two text encoders) and Flux
(the transformer). Then the properties the design rests on: multiplier 0 is the base exactly; two LoRAs add
linearly; A -> B -> A returns to A bit-exactly (no refit leak, NVIDIA/TensorRT#3628); a batch without LoRA runs the
unchanged base sessions; two threads with different sets each get their own image; ORT's own adapters do nothing
under IO binding (so nobody relies on them).
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from engines.config import LoraSettings, RuntimeSettings
from engines.engine import OrtEngine
from engines.errors import InvalidRequestError
from engines.lora.active import Adapters
from engines.pipelines.contract import image_rng
from engines.types.request import Batch, ImageSpec, LoraUse
from tests import lora_files as lf

pytestmark = pytest.mark.slow
PROMPTS = ["a photo of an astronaut riding a horse", "a red cube on a table, studio lighting"]
SEEDS = [11, 12]
STEPS, GUIDANCE = 6, 7.5


def _engine(model: Path, lora_dir: Path | None, **lora: Any) -> OrtEngine:
    settings = RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True,
                               lora=LoraSettings(dir=str(lora_dir) if lora_dir else "", **lora))
    engine = OrtEngine(model, settings)
    engine.load()
    return engine


def _use(engine: OrtEngine, name: str, te: float = 1.0, unet: float | None = None) -> LoraUse:
    found = {f.name: f for f in engine.loras()}[name]
    assert not found.problem, found.problem
    return LoraUse(name, found.sha256, te, te if unet is None else unet)


def _batch(uses: tuple[LoraUse, ...] = (), size: int = 64, steps: int = STEPS, guidance: float = GUIDANCE) -> Batch:
    return Batch(tuple(ImageSpec(p, seed=s, guidance_scale=guidance) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                 size, size, steps, "euler", loras=uses)


def _images(engine: OrtEngine, batch: Batch) -> np.ndarray:
    return np.stack([np.asarray(i.image) for i in engine.generate(batch).images])


def _compare(mine: np.ndarray, theirs: np.ndarray, what: str) -> None:
    diff = np.abs(mine.astype(np.int16) - theirs.astype(np.int16))
    assert mine.shape == theirs.shape
    assert (diff <= 1).mean() >= 0.999, f"{what}: {(diff > 1).sum()} values differ by more than 1/255"
    assert diff.max() <= 3, f"{what}: max difference {diff.max()}/255"


def _changed(a: np.ndarray, b: np.ndarray) -> float:
    return float((np.abs(a.astype(np.int16) - b.astype(np.int16)) > 2).mean())


@pytest.fixture(scope="module")
def sd1(tiny_build: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The tiny SD 1.x with one random LoRA on UNet and text encoder, saved as PEFT and as kohya (alpha 2, rank
    4: scale 0.5), a second LoRA on the UNet only, and both stacked in one file (rank 8)."""
    import diffusers

    onnx_dir, diffusers_dir = tiny_build
    pipe = diffusers.StableDiffusionPipeline.from_pretrained(diffusers_dir, safety_checker=None)
    unet = lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=1, scale=0.5)
    te = lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 4, seed=2, scale=0.5)
    other = lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=3, scale=0.5)
    folder = tmp_path_factory.mktemp("loras")
    lf.peft_file(folder / "style.safetensors", {"unet": unet, "text_encoder": te})
    lf.kohya_file(folder / "style_kohya.safetensors", {"unet": unet, "text_encoder": te}, alpha=2.0)
    lf.peft_file(folder / "other.safetensors", {"unet": other})
    stacked = {k: torch.cat([unet[k], other[k]], dim=0 if "lora_A" in k else 1) for k in unet}
    lf.peft_file(folder / "both.safetensors", {"unet": stacked})
    return {"onnx": onnx_dir, "diffusers": diffusers_dir, "folder": folder, "engine": _engine(onnx_dir, folder)}


def _diffusers_images(pipe: Any, latents: np.ndarray, size: int = 64, steps: int = STEPS,
                      guidance: float = GUIDANCE, **call: Any) -> np.ndarray:
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        images = pipe(PROMPTS, height=size, width=size, num_inference_steps=steps, guidance_scale=guidance,
                      latents=torch.from_numpy(latents), output_type="np", **call).images
    return np.asarray((images * 255).round().astype(np.uint8))


def _sd_reference(kind: Any, diffusers_dir: Path, onnx_dir: Path, lora: Path | None, scale: float) -> Any:
    import diffusers

    extra = {} if kind is diffusers.StableDiffusionXLPipeline else {"safety_checker": None}
    pipe = kind.from_pretrained(diffusers_dir, **extra)
    config = json.loads((onnx_dir / "scheduler" / "scheduler_config.json").read_text())
    pipe.scheduler = diffusers.EulerDiscreteScheduler.from_config(config)
    if lora is not None:
        pipe.load_lora_weights(str(lora.parent), weight_name=lora.name)
        pipe.fuse_lora(lora_scale=scale)
    return pipe


def _latents(channels: int = 4, size: int = 64) -> np.ndarray:
    return np.stack([image_rng(s).standard_normal((channels, size // 8, size // 8), dtype=np.float32)
                     for s in SEEDS])


@pytest.mark.parametrize(("file", "multiplier", "reference_scale"),
                         [("style", 0.8, 0.8), ("style_kohya", 1.6, 1.6)], ids=["peft", "kohya"])
def test_sd1_images_match_diffusers_fuse_lora(sd1: dict[str, Any], file: str, multiplier: float,
                                              reference_scale: float) -> None:
    """diffusers applies the kohya file's alpha / rank as A1111's calc_scale does (alpha 2 at rank 4 halves the
    product), so the kohya file at 1.6 is the PEFT file at 0.8, bit for bit."""
    import diffusers

    engine = sd1["engine"]
    pipe = _sd_reference(diffusers.StableDiffusionPipeline, sd1["diffusers"], sd1["onnx"],
                         sd1["folder"] / f"{file}.safetensors", reference_scale)
    theirs = _diffusers_images(pipe, _latents())
    mine = _images(engine, _batch((_use(engine, file, multiplier),)))
    _compare(mine, theirs, f"sd1 {file}")
    base = _images(engine, _batch())
    assert _changed(mine, base) > 0.3, "the LoRA must change the image for the comparison to mean anything"
    assert np.array_equal(mine, _images(engine, _batch((_use(engine, "style", 0.8),))))


def test_sd1_text_encoder_and_unet_outputs_match_diffusers(sd1: dict[str, Any]) -> None:
    """The adapted components themselves, before any sampling: hidden states and one UNet evaluation."""
    import diffusers

    engine = sd1["engine"]
    pipe = _sd_reference(diffusers.StableDiffusionPipeline, sd1["diffusers"], sd1["onnx"],
                         sd1["folder"] / "style.safetensors", 0.7)
    use = _use(engine, "style", 0.7)
    weights = engine._lora.weights((use,))  # type: ignore[union-attr]
    p = engine.pipeline
    name = next(iter(p.text_encoder.inputs))
    ids = p.tokenizer(PROMPTS).ids.astype(p.text_encoder.input_dtype(name))
    adapters = Adapters(weights)
    hidden = _run_component(p.text_encoder, {name: ids}, adapters)
    sample = np.random.default_rng(0).standard_normal((2, 4, 8, 8)).astype(np.float32)
    unet_out = _run_component(p.unet, {p.io.sample: sample, p.io.timestep: np.array([500], np.int64).astype(
        p.unet.input_dtype(p.io.timestep)).reshape(p.io.timestep_shape), p.io.hidden: hidden}, adapters)
    assert adapters.adapted == {"text_encoder", "unet"}
    with torch.no_grad():
        their_hidden = pipe.text_encoder(torch.from_numpy(ids.astype(np.int64)))[0].numpy()
        their_unet = pipe.unet(torch.from_numpy(sample), 500, torch.from_numpy(hidden)).sample.numpy()
    np.testing.assert_allclose(hidden, their_hidden, atol=2e-4, rtol=1e-4)
    np.testing.assert_allclose(unet_out, their_unet, atol=2e-4, rtol=1e-4)
    base_hidden = _run_component(p.text_encoder, {name: ids})
    assert np.abs(base_hidden - hidden).max() > 1e-2  # the text encoder LoRA reached the hidden states


def _run_component(model: Any, feeds: dict[str, np.ndarray], adapters: Adapters | None = None) -> np.ndarray:
    """One run of an OrtModel through its IO binding path, with the batch's LoRA weights when given."""
    out_name = model.outputs[0]
    session = model.variant.session if model.variant is not None and adapters is not None \
        and adapters.of(model.component) else model.session
    shape = session.run([out_name], feeds)[0].shape  # the output's shape, on the same session
    value = ort.OrtValue.ortvalue_from_shape_and_type(list(shape), np.float32, "cpu", 0)
    model.run(feeds, {out_name: value}, adapters)
    return np.asarray(value.numpy())


def test_multiplier_zero_is_the_base_image_exactly(sd1: dict[str, Any]) -> None:
    engine = sd1["engine"]
    base = _images(engine, _batch())
    zero = _images(engine, _batch((_use(engine, "style", 0.0),)))
    assert np.array_equal(zero, base)


def test_a_batch_without_lora_runs_todays_graphs_bit_exactly(sd1: dict[str, Any]) -> None:
    """The engine with a LoRA library and without one give the same no-LoRA images, bit for bit: the base
    sessions are never the overridable variants."""
    plain = _engine(sd1["onnx"], None)
    try:
        assert np.array_equal(_images(plain, _batch()), _images(sd1["engine"], _batch()))
        assert plain.capabilities().lora == {}
    finally:
        plain.close()


def test_the_provider_reported_is_the_session_that_ran(sd1: dict[str, Any]) -> None:
    """``x-sdserve-provider`` (BatchResult.provider) names the session the batch's denoiser ran on: under a
    TensorRT policy a LoRA batch runs on the variant, which is built in process and gets CUDA only. On this CPU both
    sessions are on the CPU provider, so the variant's label is marked here (a label, not an ORT object) to see
    which session the report reads."""
    engine = sd1["engine"]
    unet = engine.pipeline.unet
    assert unet.variant is not None
    real = unet.variant.provider
    unet.variant.provider = f"{real} (the LoRA variant)"
    try:
        with_lora = engine.generate(_batch((_use(engine, "style"),)))
        without = engine.generate(_batch())
    finally:
        unet.variant.provider = real
    assert with_lora.provider == f"{real} (the LoRA variant)"
    assert without.provider == unet.provider == unet.session.get_providers()[0]


def test_a_merge_reads_the_base_weights_through_the_staging_buffers(sd1: dict[str, Any]) -> None:
    """Every base weight a merge reads goes up through Runtime.upload (pinned staging on a GPU, recorded in
    host_reads under its tag): none is bound as a pageable host feed of the merge graph."""
    engine = sd1["engine"]
    runtime = engine._runtime
    runtime.host_reads.clear()
    engine.generate(_batch((_use(engine, "other", 0.37, 0.37),)))  # a set no other test merges
    tags = [r.tag for r in runtime.host_reads]
    assert "lora_base" in tags
    assert not [t for t in tags if t.startswith("lora_merge") and t.endswith(":W")], tags


def test_two_loras_add_linearly(sd1: dict[str, Any]) -> None:
    """{style, other} merges to the same weights as one file holding both factor pairs stacked (rank 8), and each
    merged delta is the sum of the single ones."""
    engine = sd1["engine"]
    lora = engine._lora
    assert lora is not None
    a, b = _use(engine, "style", 0.9), _use(engine, "other", 0.6)
    pair = lora.weights((a, b))["unet"]
    one, two = lora.weights((a,))["unet"], lora.weights((b,))["unet"]
    comp = lora.components["unet"]
    for name, merged in pair.items():
        base = comp.base[name]
        np.testing.assert_allclose(merged.numpy() - base, (one[name].numpy() - base) + (two[name].numpy() - base),
                                   atol=1e-5)
    both = _use(engine, "both", 1.0)
    separate = _images(engine, _batch((_use(engine, "style", 0.0, 1.0), _use(engine, "other", 1.0))))  # UNet only
    _compare(_images(engine, _batch((both,))), separate, "stacked file vs two files")


def test_a_then_b_then_a_returns_to_a_bit_exactly(sd1: dict[str, Any]) -> None:
    """Merged sets are new tensors, never written over the base: going back to A after B leaves nothing of B,
    whether A comes from the cache or is merged again after an eviction."""
    engine = sd1["engine"]
    a, b = (_use(engine, "style", 1.0),), (_use(engine, "other", 1.0),)
    first = _images(engine, _batch(a))
    middle = _images(engine, _batch(b))
    again = _images(engine, _batch(a))
    assert np.array_equal(first, again)
    assert _changed(first, middle) > 0.3
    assert engine._lora is not None
    sizes = [engine._lora.set_bytes(a), engine._lora.set_bytes(b)]
    budget_mb = -(-max(sizes) // 2**20)  # each set fits, both do not: every switch merges again
    assert sum(sizes) > budget_mb * 2**20
    tight = _engine(sd1["onnx"], sd1["folder"], cache_mb=budget_mb)
    try:
        assert tight._lora is not None
        ta = _images(tight, _batch((_use(tight, "style", 1.0),)))
        _images(tight, _batch((_use(tight, "other", 1.0),)))
        assert np.array_equal(_images(tight, _batch((_use(tight, "style", 1.0),))), ta)
        assert np.array_equal(ta, first)
        stats = tight._lora.stats
        assert stats.misses == 3  # every switch merged again: nothing stayed cached
        assert stats.evictions >= 2
    finally:
        tight.close()


def test_concurrent_batches_with_different_sets_get_their_own_images(sd1: dict[str, Any]) -> None:
    engine = sd1["engine"]
    sets = {"base": (), "style": (_use(engine, "style", 1.0),), "other": (_use(engine, "other", 1.0),)}
    alone = {name: _images(engine, _batch(uses, steps=3)) for name, uses in sets.items()}
    results: dict[str, list[np.ndarray]] = {name: [] for name in sets}
    errors: list[BaseException] = []

    def worker(name: str) -> None:
        try:
            for _ in range(3):
                results[name].append(_images(engine, _batch(sets[name], steps=3)))
        except BaseException as exc:  # reported below, with the others' results
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(name,)) for name in sets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    for name, got in results.items():
        assert len(got) == 3
        for image in got:
            assert np.array_equal(image, alone[name]), f"{name}: another set's weights leaked into the batch"


def test_set_order_and_names_do_not_change_the_key_or_image(sd1: dict[str, Any]) -> None:
    engine = sd1["engine"]
    a, b = _use(engine, "style", 0.5), _use(engine, "other", 0.4)
    ab, ba = _batch((a, b)), _batch((b, a))
    assert ab.lora_key == ba.lora_key
    assert np.array_equal(_images(engine, ab), _images(engine, ba))


def test_separate_te_and_unet_multipliers_reach_their_components(sd1: dict[str, Any]) -> None:
    """``<lora:x:te:unet>``: te 0 leaves the text encoder alone, unet 0 the UNet."""
    engine = sd1["engine"]
    only_unet = engine._lora.weights((_use(engine, "style", 0.0, 1.0),))  # type: ignore[union-attr]
    only_te = engine._lora.weights((_use(engine, "style", 1.0, 0.0),))  # type: ignore[union-attr]
    comp = engine._lora.components  # type: ignore[union-attr]
    assert "text_encoder" not in only_unet  # not bound: the text encoder runs its base session
    assert "unet" not in only_te
    assert any(np.abs(v.numpy() - comp["unet"].base[k]).max() > 1e-3 for k, v in only_unet["unet"].items())
    assert any(np.abs(v.numpy() - comp["text_encoder"].base[k]).max() > 1e-3
               for k, v in only_te["text_encoder"].items())


def test_an_unknown_or_vanished_set_is_refused_naming_the_field(sd1: dict[str, Any]) -> None:
    engine = sd1["engine"]
    with pytest.raises(InvalidRequestError) as caught:
        engine.generate(_batch((LoraUse("ghost", "0" * 64),)))
    assert caught.value.param == "loras"
    plain = _engine(sd1["onnx"], None)
    try:
        with pytest.raises(InvalidRequestError, match="no LoRA library"):
            plain.generate(_batch((LoraUse("style", "0" * 64),)))
    finally:
        plain.close()


@pytest.fixture(scope="module")
def sdxl(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    import diffusers

    from engines.build.tiny import build_tiny

    root = tmp_path_factory.mktemp("sdxl-lora")
    build_tiny(root / "onnx", diffusers_out=root / "diffusers", family="sdxl")
    pipe = diffusers.StableDiffusionXLPipeline.from_pretrained(root / "diffusers")
    parts = {"unet": lf.lora_factors(pipe.unet, lf.UNET_TARGETS, 4, seed=5, scale=0.5),
             "text_encoder": lf.lora_factors(pipe.text_encoder, lf.TE_TARGETS, 4, seed=6, scale=0.5),
             "text_encoder_2": lf.lora_factors(pipe.text_encoder_2, lf.TE_TARGETS, 4, seed=7, scale=0.5)}
    folder = root / "loras"
    lf.peft_file(folder / "xl.safetensors", parts)
    lf.kohya_file(folder / "xl_kohya.safetensors", parts, alpha=4.0, xl=True)
    lf.kohya_sgm_file(folder / "xl_sgm.safetensors", parts["unet"], alpha=2.0)
    return {"onnx": root / "onnx", "diffusers": root / "diffusers", "folder": folder,
            "engine": _engine(root / "onnx", folder)}


@pytest.mark.parametrize("file", ["xl", "xl_kohya", "xl_sgm"])
def test_sdxl_images_match_diffusers_fuse_lora_with_both_text_encoders(sdxl: dict[str, Any], file: str) -> None:
    """PEFT, kohya with diffusers' block names, and kohya with the original SGM block names (input_blocks/
    middle_block/output_blocks, as kohya's SDXL trainer writes them; UNet only)."""
    import diffusers

    engine = sdxl["engine"]
    listed = {f.name: f for f in engine.loras()}[file]
    assert not listed.problem, listed.problem
    expected = {"unet"} if file == "xl_sgm" else {"unet", "text_encoder", "text_encoder_2"}
    assert set(listed.components) == expected
    pipe = _sd_reference(diffusers.StableDiffusionXLPipeline, sdxl["diffusers"], sdxl["onnx"],
                         sdxl["folder"] / f"{file}.safetensors", 0.9)
    theirs = _diffusers_images(pipe, _latents())
    mine = _images(engine, _batch((_use(engine, file, 0.9),)))
    _compare(mine, theirs, f"sdxl {file}")
    assert _changed(mine, _images(engine, _batch())) > 0.3


@pytest.mark.parametrize("family", ["flux", "sd3"])
def test_a_dit_text_encoder_lora_changes_the_image_it_claims_and_matches_diffusers(
        family: str, dit_build: Callable[[str], tuple[Path, Path]], tmp_path: Path) -> None:
    """A text-encoder-only LoRA on Flux (CLIP) and SD 3 (both CLIPs): before, the DiT pipeline bound the base
    session of every text encoder, so the image was bit-identical to the base (max |diff| 0) while the header, the
    infotext and the signed manifest said the LoRA applied."""
    import diffusers

    from engines.pipelines.flow import pack_latents

    onnx_dir, diffusers_dir = dit_build(family)
    kind = diffusers.FluxPipeline if family == "flux" else diffusers.StableDiffusion3Pipeline
    pipe = kind.from_pretrained(diffusers_dir)
    encoders = ["text_encoder"] if family == "flux" else ["text_encoder", "text_encoder_2"]
    lf.peft_file(tmp_path / "te_only.safetensors", {name: lf.lora_factors(getattr(pipe, name), lf.TE_TARGETS, 4,
                                                                           seed=11, scale=2.0) for name in encoders})
    engine = _engine(onnx_dir, tmp_path)
    try:
        assert set({f.name: f for f in engine.loras()}["te_only"].components) == set(encoders)
        images = tuple(ImageSpec(p, seed=s, guidance_scale=3.5) for p, s in zip(PROMPTS, SEEDS, strict=True))
        result = engine.generate(Batch(images, 64, 64, 4, loras=(_use(engine, "te_only", 1.0, 0.0),)))
        with_lora = np.stack([np.asarray(i.image) for i in result.images])
        base = _images(engine, Batch(images, 64, 64, 4))
        assert _changed(with_lora, base) > 0.0, "the text-encoder LoRA left the image unchanged"
        assert result.provider == engine.pipeline.transformer.provider  # the denoiser ran its base session
        assert result.adapted == tuple(sorted(encoders))  # every component the file adapts ran adapted weights
        # a variant (a second copy of the weights) only for what a file adapts: none for the denoiser or T5
        assert set(engine.capabilities().lora["sessions"]) == set(encoders)
        assert engine.pipeline.transformer.variant is None
        # Parity: diffusers' loader on the same file, fused into exactly the encoders it adapts (Flux's
        # fuse_lora fuses only the transformer unless told: lora_pipeline.py FluxLoraLoaderMixin.fuse_lora).
        pipe.load_lora_weights(str(tmp_path), weight_name="te_only.safetensors")
        pipe.fuse_lora(components=encoders, lora_scale=1.0)
        noise = np.stack([image_rng(s).standard_normal((16, 8, 8), dtype=np.float32) for s in SEEDS])
        theirs = _diffusers_images(pipe, pack_latents(noise) if family == "flux" else noise, steps=4,
                                   guidance=3.5, **({"max_sequence_length": 512} if family == "flux" else {}))
        _compare(with_lora, theirs, f"{family} text-encoder LoRA")
        assert _changed(base, theirs) > 0.1  # the reference moved too: the base image would fail the comparison
        # a file that adapts the denoiser, added and refreshed: its variant is built then, and used
        lf.peft_file(tmp_path / "dit.safetensors",
                     {"transformer": lf.lora_factors(pipe.transformer, lf.DIT_TARGETS, 4, seed=3, scale=0.5)})
        engine.refresh_loras()
        assert engine.pipeline.transformer.variant is not None
        assert engine.generate(Batch(images, 64, 64, 2, loras=(_use(engine, "dit", 1.0),))).adapted == \
            ("transformer",)
    finally:
        engine.close()


def test_flux_transformer_lora_matches_diffusers(dit_build: Callable[[str], tuple[Path, Path]],
                                                 tmp_path: Path) -> None:
    """A diffusers-format Flux LoRA (``transformer.<module>.lora_A.weight``) on attention and MLP."""
    import diffusers

    from engines.pipelines.flow import pack_latents

    onnx_dir, diffusers_dir = dit_build("flux")
    pipe = diffusers.FluxPipeline.from_pretrained(diffusers_dir)
    factors = lf.lora_factors(pipe.transformer, lf.DIT_TARGETS, 4, seed=9, scale=0.5)
    lf.peft_file(tmp_path / "flux_style.safetensors", {"transformer": factors})
    engine = _engine(onnx_dir, tmp_path)
    try:
        use = _use(engine, "flux_style", 0.8)
        batch = Batch(tuple(ImageSpec(p, seed=s, guidance_scale=3.5) for p, s in zip(PROMPTS, SEEDS, strict=True)),
                      64, 64, 4, loras=(use,))
        mine = _images(engine, batch)
        pipe.load_lora_weights(str(tmp_path), weight_name="flux_style.safetensors")
        pipe.fuse_lora(lora_scale=0.8)
        noise = np.stack([image_rng(s).standard_normal((16, 8, 8), dtype=np.float32) for s in SEEDS])
        pipe.set_progress_bar_config(disable=True)
        with torch.no_grad():
            theirs = pipe(PROMPTS, height=64, width=64, num_inference_steps=4, guidance_scale=3.5,
                          latents=torch.from_numpy(pack_latents(noise)), output_type="np",
                          max_sequence_length=512).images
        _compare(mine, np.asarray((theirs * 255).round().astype(np.uint8)), "flux transformer LoRA")
        base = _images(engine, Batch(batch.images, 64, 64, 4))
        assert _changed(mine, base) > 0.1
    finally:
        engine.close()


def test_under_a_tensorrt_policy_lora_variants_get_the_cuda_provider_only(sd1: dict[str, Any]) -> None:
    """The base sessions load prebuilt engines (TensorRT); the LoRA variants are graphs built in process (bytes),
    which a TensorRT policy gives the CUDA provider only (engines/runtime/sessions.py session_providers): no
    engine is built on the node for them and no refit exists to leak one set's weights into the next."""
    from engines.runtime.sessions import session_providers

    lora = sd1["engine"]._lora
    assert all(isinstance(c.variant.source, bytes) for c in lora.components.values())
    trt = RuntimeSettings(providers=("TensorrtExecutionProvider", "CUDAExecutionProvider"))
    assert [p for p, _ in session_providers(trt, in_process=True)] == ["CUDAExecutionProvider"]
    assert [p for p, _ in session_providers(trt, in_process=False)][0] == "TensorrtExecutionProvider"


def test_ort_adapters_have_no_effect_under_io_binding(tmp_path: Path) -> None:
    """Guard: RunOptions.add_active_adapter is ignored by run_with_iobinding (OrtApis::RunWithBinding only logs
    it, onnxruntime/core/session/onnxruntime_c_api.cc), while binding the overridable initializer works. If ORT
    ever changes this, the test fails and the design can be revisited; until then nothing may rely on adapters."""
    w = numpy_helper.from_array(np.ones((2, 2), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2]),
                               helper.make_tensor_value_info("W", TensorProto.FLOAT, [2, 2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    adapter_file = tmp_path / "a.onnx_adapter"
    fmt = ort.AdapterFormat()
    fmt.set_adapter_version(1)
    fmt.set_model_version(1)
    fmt.set_parameters({"W": ort.OrtValue.ortvalue_from_numpy(np.full((2, 2), 9, np.float32))})
    fmt.export_adapter(str(adapter_file))
    adapter = ort.LoraAdapter()
    adapter.Load(str(adapter_file))
    options = ort.RunOptions()
    options.add_active_adapter(adapter)
    x = np.eye(2, dtype=np.float32)
    assert session.run(None, {"x": x}, options)[0][0, 0] == 9  # plain run: the adapter applies
    binding = session.io_binding()
    binding.bind_cpu_input("x", x)
    binding.bind_output("y")
    session.run_with_iobinding(binding, options)
    assert binding.copy_outputs_to_cpu()[0][0, 0] == 1  # IO binding: ignored, the stored weight ran
    binding.bind_ortvalue_input("W", ort.OrtValue.ortvalue_from_numpy(np.full((2, 2), 9, np.float32)))
    session.run_with_iobinding(binding)
    assert binding.copy_outputs_to_cpu()[0][0, 0] == 9  # the overridable initializer, bound: what we use


def test_lora_variant_of_an_external_data_model_loads_its_weights_beside_it(sd1: dict[str, Any],
                                                                           tmp_path: Path) -> None:
    """A component whose weights are external (>2 GB models are saved so) gets a variant whose protobuf carries
    no weights; ORT reads them from the model's folder (session.model_external_initializers_file_folder_path)."""
    model = shutil.copytree(sd1["onnx"], tmp_path / "model")
    unet = model / "unet" / "model.onnx"
    proto = onnx.load(str(unet))
    onnx.save_model(proto, str(unet), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data", size_threshold=1024)
    (model / "manifest.json").unlink()
    engine = OrtEngine(model, RuntimeSettings(providers=("CPUExecutionProvider",), allow_cpu=True, verify="off",
                                              lora=LoraSettings(dir=str(sd1["folder"]))))
    engine.load()
    try:
        assert engine._lora is not None
        base = engine._lora.components["unet"].base
        # the merge's W is a read-only map of the weight file, not a second copy in host memory
        assert base and all(isinstance(w, np.memmap) and not w.flags.writeable for w in base.values())
        assert all(Path(w.filename or "").name == "model.onnx.data" for w in base.values())  # type: ignore[attr-defined]
        use = (_use(engine, "style", 1.0),)
        _compare(_images(engine, _batch(use)), _images(sd1["engine"], _batch(use)), "external-data variant")
    finally:
        engine.close()


@pytest.mark.plugin_ep
def test_lora_on_the_openvino_profile_runs_every_node_on_the_accelerator(openvino_model: Path, sd1: dict[str, Any],
                                                                       tmp_path: Path) -> None:
    """The fail-closed path with LoRA: the base sessions load the EP-context artifacts; the LoRA variants load the
    plain ONNX on the same plugin EP (the CPU provider refused, the placement audit on), and the adapted image
    matches the CPU's within 1/255."""
    from engines.config import load_matrix
    from server.settings import CONFIG_DIR, load_settings
    from tests.plugin_ep import EP, profile

    settings = load_settings("openvino", profile(tmp_path)).runtime
    engine = OrtEngine(openvino_model, settings.model_copy(update={"lora": LoraSettings(dir=str(sd1["folder"]))}),
                       load_matrix(CONFIG_DIR / "matrix.toml"))
    engine.preflight()
    engine.load()
    try:
        use = (_use(engine, "style", 1.0),)
        adapted = _images(engine, _batch(use))
        _compare(adapted, _images(sd1["engine"], _batch(use)), "LoRA on OpenVINO vs the CPU")
        caps = engine.capabilities()
        assert caps.accelerated
        for name in ("unet:lora", "text_encoder:lora"):
            placement = caps.placement_summary[name]
            assert set(placement.nodes_by_provider) == {EP} and placement.ok, placement
        assert _changed(adapted, _images(engine, _batch())) > 0.3
    finally:
        engine.close()


def test_a_file_changed_after_the_scan_is_refused_until_refreshed(sd1: dict[str, Any], tmp_path: Path) -> None:
    """The set key is the sha256 the scan computed: bytes changed under it are refused, never merged under the
    old hash; a refresh hashes them again."""
    shutil.copy(sd1["folder"] / "other.safetensors", tmp_path / "mine.safetensors")
    engine = _engine(sd1["onnx"], tmp_path)
    try:
        use = _use(engine, "mine", 1.0)
        data = bytearray((tmp_path / "mine.safetensors").read_bytes())
        data[-1] ^= 0xFF
        (tmp_path / "mine.safetensors").write_bytes(bytes(data))
        with pytest.raises(InvalidRequestError, match="changed on disk") as caught:
            engine.generate(_batch((use,)))
        assert caught.value.param == "loras"
        engine.refresh_loras()
        fresh = _use(engine, "mine", 1.0)
        assert fresh.sha256 != use.sha256
        engine.generate(_batch((fresh,), steps=2))
    finally:
        engine.close()


class _Counting:
    """A real session, its IO-binding runs counted (the warm-up's evidence)."""

    def __init__(self, session: ort.InferenceSession) -> None:
        self.session, self.runs = session, 0

    def io_binding(self) -> Any:
        return self.session.io_binding()

    def run_with_iobinding(self, binding: Any, *args: Any) -> None:
        self.runs += 1
        self.session.run_with_iobinding(binding, *args)


def test_the_boot_self_test_warms_every_lora_variant(sd1: dict[str, Any], tmp_path: Path) -> None:
    """No variant meets its first input shape on a request: the self-test runs a canary through each (stored
    weights, nothing merged; the engine checks the image is sane)."""
    engine = _engine(sd1["onnx"], sd1["folder"])
    try:
        assert engine._lora is not None
        counters = {}
        for name, comp in engine._lora.components.items():
            counters[name] = _Counting(comp.variant.session)
            comp.variant.session = counters[name]  # type: ignore[assignment]
        engine.self_test()
        assert all(c.runs > 0 for c in counters.values()), {n: c.runs for n, c in counters.items()}
    finally:
        engine.close()


def test_a_component_that_misses_its_merged_weights_fails_the_batch_instead_of_claiming_them(
        sd1: dict[str, Any]) -> None:
    """The pre-fix Flux defect, reproduced on purpose: a text encoder whose variant is not attached runs its base
    weights although the batch merged a LoRA for it. The engine compares the components it merged for with those
    that bound the merged weights (OrtModel.bound) and refuses the batch; with the variant back it runs and says
    which components ran adapted."""
    from engines.errors import InferenceError

    engine = sd1["engine"]
    use = _use(engine, "style", 1.0)
    encoder = engine.pipeline.text_encoder
    variant, encoder.variant = encoder.variant, None
    try:
        with pytest.raises(InferenceError, match="merged for text_encoder but the batch ran their base weights"):
            engine.generate(_batch((use,)))
    finally:
        encoder.variant = variant
    assert engine.generate(_batch((use,))).adapted == ("text_encoder", "unet")
    assert engine.generate(_batch()).adapted == ()


def test_a_set_over_the_lora_budget_is_refused_by_name_before_any_merge(sd1: dict[str, Any]) -> None:
    """A set whose merged tensors exceed [runtime.lora] cache_mb is refused at admission (lora_cost_s) and at
    generate, naming the field and the budget; before, it was merged for its batch (an out-of-memory at batch time
    on a Flux-size LoRA)."""
    from engines.errors import InvalidRequestError

    engine = _engine(sd1["onnx"], sd1["folder"], cache_mb=1)
    try:
        assert engine._lora is not None
        use = (_use(engine, "style", 1.0),)
        assert engine._lora.set_bytes(use) > 2**20  # the tiny UNet + text encoder set: 2 MiB merged
        for call in (lambda: engine.lora_cost_s(use), lambda: engine.generate(_batch(use))):
            with pytest.raises(InvalidRequestError, match=r"over this server's LoRA budget of 1 MiB") as caught:
                call()
            assert caught.value.param == "loras"
        assert engine._lora.stats.misses == 0  # nothing was merged
        assert engine.lora_cost_s(()) == 0.0
    finally:
        engine.close()


def test_admission_prices_a_merge_by_the_bytes_it_writes(sd1: dict[str, Any]) -> None:
    """The merge cost grows with the weights a set touches (the UNet-only file touches fewer than the file that
    also adapts the text encoder), at the rate this server's merges ran once one has."""
    from engines.lora.manager import FIRST_MERGE_BYTES_PER_S

    engine = _engine(sd1["onnx"], sd1["folder"])
    try:
        lora = engine._lora
        assert lora is not None
        style, other = (_use(engine, "style", 1.0),), (_use(engine, "other", 1.0),)
        assert lora.set_bytes(style) > lora.set_bytes(other) > 0
        assert engine.lora_cost_s(style) == pytest.approx(lora.set_bytes(style) / FIRST_MERGE_BYTES_PER_S)
        _images(engine, _batch(style))
        assert engine.lora_cost_s(style) == 0.0  # cached
        stats = lora.stats
        assert stats.merged_bytes_total == lora.set_bytes(style) and stats.merge_seconds_total > 0
        rate = stats.merged_bytes_total / stats.merge_seconds_total
        assert engine.lora_cost_s(other) == pytest.approx(lora.set_bytes(other) / rate)
    finally:
        engine.close()
