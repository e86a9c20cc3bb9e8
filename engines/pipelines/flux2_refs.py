"""FLUX.2 [klein] reference images: instruction edits with one to ``REFERENCES`` input images, as diffusers'
``Flux2KleinPipeline`` (0.42) takes ``image=`` (a mixin of the served ``Flux2Pipeline``, engines/pipelines/flux2.py;
the VAE encoder comes from engines/build/flux2_refs.py).

Per input image (engines/types/request.py ``EditImage.references``, in the order sent):

- ``Flux2ImageProcessor.check_image_input``: each side at least ``MIN_SIDE`` pixels, the aspect at most
  ``MAX_ASPECT`` (else a 400 naming ``image``, where diffusers raises);
- over ``MAX_AREA`` pixels it is resized (Lanczos) to that area at its aspect (``_resize_to_target_area``: each side
  ``int(side · sqrt(area / w·h))``); then each side is floored to the multiple of 16 (the VAE factor × the 2×2
  patch) by a centre crop (``resize_mode="crop"``: ``Flux2ImageProcessor._resize_and_crop`` crops, it does not
  scale);
- the VAE encoder's mean (``sample_mode="argmax"``), 2×2-patchified and batch-normalised (the exported encoder does
  both), flattened row-major into tokens;
- position ids ``(T, row, col, 0)`` with ``T = 10 + 10 k`` for the k-th image (``_prepare_image_ids``).

The images' tokens follow the noisy ones in every transformer call, CFG's negative rows included, and their output
is dropped (engines/pipelines/flow_extra.py). The exported transformer flattens its ``[B, 128, h, w]`` input into
tokens itself, so ``LatentJoin`` lays the joint sequence out as a one-row image ``[B, 128, 1, h·w + refs]`` and
takes the noisy part back (no transformer of its own). The schedule's shift counts the noisy tokens only.

The output size: the request's, or the first image's size as encoded (``flux2_size``: diffusers'
``height = height or image_height`` in its loop over the images). The denoising starts from noise (no strength).

With the VAE encoder the folder also serves img2img (variations: the routes send an edit without a mask to an
instruction edit) as every DiT family does it (engines/pipelines/flow_edits.py, diffusers' Flux img2img formulas)
in FLUX.2's latent space: the encoder's moments are already patchified and normalised, so the sample, the noise
and the loop are the txt2img ones (scale 1, shift 0). diffusers has no FLUX.2 img2img pipeline to compare with.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper
from PIL import Image

from engines.errors import InvalidRequestError
from engines.numerics.rows import Buffers, Runnable, shape_feed
from engines.numerics.step_graph import elem_type, serialize
from engines.pipelines.flow import DitConditioning, FlowPipeline, run
from engines.pipelines.flow_edits import ReferenceEdits
from engines.pipelines.flow_extra import ExtraJoin, ExtraTokens
from engines.pipelines.flux import flux_rope
from engines.pipelines.ort_model import Feed
from engines.runtime.sessions import Runtime
from engines.types.model import ModelInfo
from engines.types.request import Batch

REFERENCES = 4
"""Input images one edit takes: Black Forest Labs documents up to 4 reference images for FLUX.2 [klein] (diffusers'
pipeline sets no limit; each image adds its tokens to every transformer call)."""
MAX_AREA = 1024 * 1024
"""Pixels above which an input image is scaled down first (diffusers' ``1024 * 1024``)."""
MIN_SIDE = 64
MAX_ASPECT = 8
"""``check_image_input``'s ``min_side_length`` and ``max_aspect_ratio``."""
TIME_SCALE = 10
"""``_prepare_image_ids``' ``scale``: the k-th image's T coordinate is ``scale + scale * k``."""


def reference_size(width: int, height: int, multiple: int = 16) -> tuple[int, int]:
    """The (width, height) an input image is encoded at: scaled to ``MAX_AREA`` when larger, floored to
    ``multiple``; a 400 naming ``image`` for what ``check_image_input`` refuses."""
    if width < MIN_SIDE or height < MIN_SIDE:
        raise InvalidRequestError(f"an input image is {width}x{height}: FLUX.2 takes input images of at least "
                                  f"{MIN_SIDE} pixels a side", param="image")
    if max(width / height, height / width) > MAX_ASPECT:
        raise InvalidRequestError(f"an input image is {width}x{height}: FLUX.2 takes input images with an aspect "
                                  f"ratio of at most {MAX_ASPECT}:1", param="image")
    if width * height > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (width * height))
        width, height = int(width * scale), int(height * scale)
    return width // multiple * multiple, height // multiple * multiple


def flux2_size(sizes: tuple[tuple[int, int], ...], multiple: int = 16) -> tuple[int, int]:
    """diffusers' output (width, height) when a call names no size: the first input image's encoded size."""
    return reference_size(*sizes[0], multiple)


def reference_sizes(sizes: tuple[tuple[int, int], ...], multiple: int = 16) -> tuple[tuple[int, int], ...]:
    """The encoded (width, height) of input images of ``sizes`` (ModelInfo.instruct_references)."""
    return tuple(reference_size(w, h, multiple) for w, h in sizes)


def reference_pixels(image: np.ndarray, multiple: int = 16) -> np.ndarray:
    """uint8 [h, w, 3] -> float32 [1, 3, height, width] in [-1, 1] as diffusers preprocesses it: Lanczos to the
    target area when larger, then a centre crop to the multiple."""
    pil = Image.fromarray(np.ascontiguousarray(image[..., :3]))
    width, height = reference_size(pil.width, pil.height, multiple)
    if pil.width * pil.height > MAX_AREA:
        scale = math.sqrt(MAX_AREA / (pil.width * pil.height))
        pil = pil.resize((int(pil.width * scale), int(pil.height * scale)), Image.Resampling.LANCZOS)
    left, top = (pil.width - width) // 2, (pil.height - height) // 2
    pixels = np.asarray(pil.crop((left, top, left + width, top + height)), dtype=np.float32) / 255.0
    return (pixels * 2.0 - 1.0).transpose(2, 0, 1)[None]


def reference_ids(grids: list[tuple[int, int]]) -> np.ndarray:
    """float32 [sum h·w, 4]: ``(10 + 10 k, row, col, 0)`` for each latent grid (h, w), row-major, in order."""
    parts = []
    for k, (h, w) in enumerate(grids):
        ids = np.zeros((h, w, 4), np.float32)
        ids[..., 0] = TIME_SCALE + TIME_SCALE * k
        ids[..., 1] = np.arange(h)[:, None]
        ids[..., 2] = np.arange(w)[None, :]
        parts.append(ids.reshape(-1, 4))
    return np.concatenate(parts)


class LatentJoin(ExtraJoin):
    """``ExtraJoin`` for a transformer that takes its latents as an image [rows, C, h, w]: the reference tokens
    [rows, R, C] joined as a one-row image [rows, C, 1, h·w + R] (the transformer flattens it into the same token
    sequence diffusers concatenates), and the noisy part of the output taken back into [rows, C, h, w]."""

    def __init__(self, make: Callable[[bytes, str], Runnable], buffers: Buffers, model_in: type[np.generic],
                 model_out: type[np.generic]) -> None:
        self.buffers, self.model_in, self.model_out = buffers, model_in, model_out

        def info(name: str, dtype: type[np.generic], rank: int) -> Any:
            return helper.make_tensor_value_info(name, elem_type(dtype), [f"{name}{k}" for k in range(rank)])

        row = helper.make_tensor("row", TensorProto.INT64, [4], [0, 0, 1, -1])
        axes = helper.make_tensor("axes", TensorProto.INT64, [1], [2])
        self._join = make(serialize([
            helper.make_node("Reshape", ["hidden", "row"], ["image"]),
            helper.make_node("Transpose", ["extra"], ["channels_first"], perm=[0, 2, 1]),
            helper.make_node("Unsqueeze", ["channels_first", "axes"], ["extra_row"]),
            helper.make_node("Concat", ["image", "extra_row"], ["out"], axis=3)], "sdserve_latent_join",
            [info("hidden", model_in, 4), info("extra", model_in, 3)], [info("out", model_in, 4)], [row, axes]),
            "flow_latent_join")
        zero = helper.make_tensor("zero", TensorProto.INT64, [1], [0])
        last = helper.make_tensor("last", TensorProto.INT64, [1], [3])
        self._take = make(serialize([
            helper.make_node("Slice", ["x", "zero", "ends", "last"], ["noisy"]),
            helper.make_node("Reshape", ["noisy", "shape"], ["out"])], "sdserve_latent_strip",
            [info("x", model_out, 4), helper.make_tensor_value_info("ends", TensorProto.INT64, [1]),
             helper.make_tensor_value_info("shape", TensorProto.INT64, [4])], [info("out", model_out, 4)],
            [zero, last]), "flow_latent_strip")

    def join(self, hidden: ort.OrtValue, extra: ort.OrtValue, prepend: bool) -> ort.OrtValue:
        rows, channels, h, w = hidden.shape()
        out = self.buffers.buffer("dit_extra_in", (rows, channels, 1, h * w + extra.shape()[1]), self.model_in)
        self._join.run({"hidden": hidden, "extra": extra}, {"out": out})
        return out

    def output(self, noisy_out: ort.OrtValue, extra: ort.OrtValue) -> ort.OrtValue:
        rows, channels, h, w = noisy_out.shape()
        return self.buffers.buffer("dit_extra_out", (rows, channels, 1, h * w + extra.shape()[1]), self.model_out)

    def strip(self, full: ort.OrtValue, into: ort.OrtValue, prepend: bool) -> None:
        rows, channels, h, w = into.shape()
        self._take.run({"x": full, "ends": shape_feed([h * w]), "shape": shape_feed([rows, channels, h, w])},
                       {"out": into})


class Flux2References(ReferenceEdits, FlowPipeline):
    """The reference-image hooks of ``Flux2Pipeline`` (listed before its base: these override FlowPipeline's)."""

    def __init__(self, folder: Path, runtime: Runtime, label: str = "", sources: dict[str, Path] | None = None) -> None:
        super().__init__(folder, runtime, label, sources)
        self.extra = LatentJoin(self._make, self.runtime, self.transformer.input_dtype("hidden_states"),
                                self.transformer.output_dtype())
        if self.editor is None:
            self.edits_unavailable = (
                f"{folder.name} has no vae_encoder/model.onnx: it serves txt2img only (export the folder with its "
                "VAE encoder to serve img2img and edits with reference images)")

    def _reference_sizes(self, batch: Batch) -> list[tuple[int, int]]:
        """The encoded (width, height) of the batch's input images; every image of a batch must give the same
        (their tokens share the rotary tables of one transformer call)."""
        sets = set()
        for spec in batch.images:
            refs = spec.edit.references if spec.edit is not None else ()
            if not 1 <= len(refs) <= REFERENCES:
                raise InvalidRequestError(f"FLUX.2 takes 1 to {REFERENCES} input images per edit, not {len(refs)}",
                                          param="image")
            sets.add(tuple(reference_size(r.shape[1], r.shape[0], self.size_multiple) for r in refs))
        if len(sets) > 1:
            raise InvalidRequestError(f"the input images of one batch must have one encoded size each (they give "
                                      f"{sorted(sets)})", param="image")
        return list(next(iter(sets)))

    def extra_tokens(self, batch: Batch) -> ExtraTokens | None:
        """The input images' latent tokens (the encoder's mean, patchified and normalised) and their ids."""
        editor = self.reference_encoder(batch)
        if editor is None:
            return None
        sizes = self._reference_sizes(batch)
        sets = [spec.edit.references for spec in batch.images if spec.edit is not None]
        distinct = list({tuple(map(id, refs)): refs for refs in sets}.values())  # a request's images share them
        encoder = editor.encoder
        name, out = next(iter(encoder.inputs)), editor.moments_output
        tokens = []
        for refs in distinct:
            parts = []
            for ref in refs:  # each at its own size: one encoder call each
                moments = run(encoder, {name: reference_pixels(ref, self.size_multiple)}, [out], None)[0]
                mean = moments[0, :self.geometry.latent_channels].astype(np.float32)
                parts.append(mean.reshape(mean.shape[0], -1).T)
            tokens.append(np.concatenate(parts))
        f = self.geometry.vae_scale_factor
        ids = reference_ids([(h // f, w // f) for w, h in sizes])
        row = {tuple(map(id, refs)): k for k, refs in enumerate(distinct)}
        return ExtraTokens(np.stack(tokens)[[row[tuple(map(id, refs))] for refs in sets]], ids)

    def transformer_feeds(self, cond: DitConditioning, guidance: np.ndarray, h: int, w: int,
                          rows: int) -> dict[str, Feed]:
        """FlowPipeline's, the rotary tables over text, noisy and reference tokens when the batch has references:
        the pipeline's ``position_feeds`` tables (text and noisy tokens) with the references' rows after them (each
        row of a table depends on its token's ids only)."""
        if cond.extra is None:
            return super().transformer_feeds(cond, guidance, h, w, rows)
        tables = self.position_feeds(cond, h, w)
        cos, sin = flux_rope(cond.extra.ids, self.axes_dim, float(self.config.get("rope_theta", 2000)))
        host = {**self.text_feeds(cond), "rope_cos": np.concatenate([tables["rope_cos"], cos]),
                "rope_sin": np.concatenate([tables["rope_sin"], sin]), **self.guidance_feeds(guidance, rows)}
        model = self.transformer
        return {key: self.runtime.upload(f"dit_{key}", value.astype(model.input_dtype(key)))
                for key, value in host.items()}

    def model_info(self, name: str, digest: str = "") -> ModelInfo:
        """Instruction edits with up to ``REFERENCES`` images where the folder has the VAE encoder."""
        info = super().model_info(name, digest)
        if self.editor is None:
            return info
        m = self.size_multiple
        return replace(info, modes=(*info.modes, "instruct"), instruct_images=REFERENCES,
                       instruct_size=partial(flux2_size, multiple=m),
                       instruct_references=partial(reference_sizes, multiple=m))
