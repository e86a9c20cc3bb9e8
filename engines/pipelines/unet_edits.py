"""Edits on the shared denoise loop: img2img and inpainting with diffusers' semantics, on the device.

As diffusers' StableDiffusion(XL)Img2ImgPipeline and StableDiffusion(XL)InpaintPipeline (0.42):

- The init image (uint8 -> [-1, 1]) goes up once (through the pinned staging buffer on a GPU) and the VAE encoder
  gives the latent distribution's moments on the device; the latents are sampled with the request's seed as
  ``DiagonalGaussianDistribution.sample`` does (``mean + exp(0.5 * clamp(logvar, -30, 20)) * eps``) and scaled by
  ``vae.config.scaling_factor``. SDXL's ``force_upcast``: an fp16 encoder of such a VAE is refused at load, so
  encoding runs in fp32 as diffusers upcasts it.
- ``strength`` picks the first step (``get_timesteps``: ``int(steps * strength)`` steps run) and the scheduler's
  ``add_noise`` at that step's noise level makes the start latents (schedulers.py: ``SchedulePlan.noising``).
- Inpainting with a 4-channel UNet blends after every step: outside the mask the latents become the image latents
  noised to the next step's level (clean after the last), with the same noise the start used. A 9-channel
  inpainting UNet instead takes ``[latents, mask, masked-image latents]`` on its channels every step. Strength 1.0
  starts from pure noise (``is_strength_max``), as txt2img does. The mask is binarized at 0.5 and taken at every
  8th pixel for the latents (torch's nearest interpolation).
- Per image, the seeded stream gives the start noise first (as txt2img), then the encoder's sample noise for the
  image (4-channel UNets, or strength < 1), then for the masked image (9-channel UNets), then any step noise.

A 9-channel model also serves txt2img as A1111 does with inpainting models (the whole image masked, the masked
image mid-gray) and img2img as a whole-image mask. The pixels outside the mask are pasted back after decoding
(``Batch.overlay``, A1111's overlay; diffusers returns the VAE's reconstruction there).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import onnxruntime as ort
from onnx import helper, numpy_helper

from engines.errors import InvalidRequestError
from engines.numerics.plan import SchedulePlan
from engines.numerics.step_graph import STATE_DTYPE, elem_type, serialize
from engines.types.request import Batch

ENCODER_OUTPUT = "latent_parameters"
MASK_THRESHOLD = 128
"""uint8 mask values at or above this repaint: diffusers' binarize at 0.5 of value / 255."""


def strength_start(steps: int, strength: float) -> tuple[int, int]:
    """(first step, steps run) for ``strength``, as diffusers' ``get_timesteps``; refuses a strength that runs no
    step."""
    if not 0.0 < strength <= 1.0:
        raise InvalidRequestError(f"strength {strength} must be in (0, 1]", param="strength")
    run = min(int(steps * strength), steps)
    if run < 1:
        raise InvalidRequestError(f"strength {strength} x {steps} steps runs no step: raise the strength or the "
                                  "steps", param="strength")
    return steps - run, run


def build_sample_graph(moments: type[np.generic], scale: float) -> bytes:
    """``latents = scale * (mean + exp(0.5 * clip(logvar, -30, 20)) * eps)`` from the encoder's moments
    [B, 2C, h, w] (mean and logvar on channels) and unit noise ``eps`` [B, C, h, w]; float32 out."""
    f32 = elem_type(STATE_DTYPE)
    inits = [numpy_helper.from_array(np.array(v, dtype=np.float32), n)
             for n, v in (("lo", -30.0), ("hi", 20.0), ("half", 0.5), ("scale", scale))]
    nodes = [helper.make_node("Cast", ["moments"], ["m32"], to=f32),
             helper.make_node("Split", ["m32"], ["mean", "logvar"], axis=1),
             helper.make_node("Clip", ["logvar", "lo", "hi"], ["clamped"]),
             helper.make_node("Mul", ["clamped", "half"], ["halved"]),
             helper.make_node("Exp", ["halved"], ["std"]),
             helper.make_node("Mul", ["std", "eps"], ["spread"]),
             helper.make_node("Add", ["mean", "spread"], ["sample"]),
             helper.make_node("Mul", ["sample", "scale"], ["latents"])]
    latent = ["B", "C", "H", "W"]
    return serialize(nodes, "sdserve_latent_sample",
                     [helper.make_tensor_value_info("moments", elem_type(moments), ["B", "C2", "H", "W"]),
                      helper.make_tensor_value_info("eps", f32, latent)],
                     [helper.make_tensor_value_info("latents", f32, latent)], inits)


def build_mix_graph(unet_in: type[np.generic], copies: int, extra: bool) -> bytes:
    """``next = keep * x + (1 - keep) * (a * image + b * noise)`` and the UNet input ``model_in`` = ``copies``
    rows of ``next * in_scale`` in the UNet's dtype (with ``extra``: the 9-channel UNet's mask and masked-image
    latents concatenated on channels). ``keep`` [B,1,h,w] is 1 where the sample stays; ``ab`` [2] holds (a, b)."""
    f32, unet = elem_type(STATE_DTYPE), elem_type(unet_in)
    latent = ["B", "C", "H", "W"]
    inits = [numpy_helper.from_array(np.array(k, dtype=np.int64), f"i{k}") for k in (0, 1)]
    inits.append(numpy_helper.from_array(np.array(1.0, dtype=np.float32), "one"))
    nodes = [helper.make_node("Gather", ["ab", "i0"], ["a"]), helper.make_node("Gather", ["ab", "i1"], ["b"]),
             helper.make_node("Mul", ["image", "a"], ["ai"]), helper.make_node("Mul", ["noise", "b"], ["bn"]),
             helper.make_node("Add", ["ai", "bn"], ["noised"]),
             helper.make_node("Sub", ["one", "keep"], ["drop"]),
             helper.make_node("Mul", ["keep", "x"], ["kept"]), helper.make_node("Mul", ["drop", "noised"], ["new"]),
             helper.make_node("Add", ["kept", "new"], ["next"]),
             helper.make_node("Mul", ["next", "in_scale"], ["scaled"]),
             helper.make_node("Cast", ["scaled"], ["scaled_u"], to=unet),
             helper.make_node("Concat", ["scaled_u"] * copies, ["rows" if extra else "model_in"], axis=0)]
    inputs = [helper.make_tensor_value_info(n, f32, latent) for n in ("x", "image", "noise")]
    inputs += [helper.make_tensor_value_info("keep", f32, ["B", 1, "H", "W"]),
               helper.make_tensor_value_info("ab", f32, [2]), helper.make_tensor_value_info("in_scale", f32, [1])]
    if extra:
        nodes.append(helper.make_node("Concat", ["rows", "extra"], ["model_in"], axis=1))
        inputs.append(helper.make_tensor_value_info("extra", unet, ["R", "E", "H", "W"]))
    outputs = [helper.make_tensor_value_info("next", f32, latent),
               helper.make_tensor_value_info("model_in", unet, ["R", "U", "H", "W"])]
    return serialize(nodes, "sdserve_edit_mix", inputs, outputs, inits)


def build_extra_graph(unet_in: type[np.generic], copies: int) -> bytes:
    """The 9-channel UNet's extra channels: ``copies`` rows of ``concat(mask, masked-image latents)`` in the UNet's
    dtype (float32 in)."""
    f32 = elem_type(STATE_DTYPE)
    nodes = [helper.make_node("Concat", ["mask", "latents"], ["joined"], axis=1),
             helper.make_node("Cast", ["joined"], ["joined_u"], to=elem_type(unet_in)),
             helper.make_node("Concat", ["joined_u"] * copies, ["extra"], axis=0)]
    return serialize(nodes, "sdserve_inpaint_extra",
                     [helper.make_tensor_value_info("mask", f32, ["B", 1, "H", "W"]),
                      helper.make_tensor_value_info("latents", f32, ["B", "C", "H", "W"])],
                     [helper.make_tensor_value_info("extra", elem_type(unet_in), ["R", "E", "H", "W"])], [])


@dataclass(frozen=True)
class EditInputs:
    """Host arrays of one edit batch, as diffusers preprocesses them."""

    pixels: np.ndarray
    """float32 [B, 3, H, W] in [-1, 1]."""
    mask: np.ndarray | None
    """float32 [B, 1, H, W] binarized (1 repaints); None: img2img on a 4-channel UNet."""
    overlay: np.ndarray | None
    """float32 [B, H, W, 1] alpha of the repainted pixels (mask / 255) for the paste-back; None: none."""
    originals: np.ndarray | None
    """uint8 [B, H, W, 3] the init images, for the paste-back."""


def edit_inputs(batch: Batch, inpainting_unet: bool) -> EditInputs:
    """The batch's images (and masks) as arrays; a 9-channel UNet's missing mask is the whole image (txt2img: a
    mid-gray image under it, as A1111 does)."""
    shape = (batch.height, batch.width)
    images, masks = [], []
    for index, spec in enumerate(batch.images):
        edit = spec.edit
        image = np.full((*shape, 3), 127.5, np.float32) if edit is None else edit.image.astype(np.float32)
        if image.shape != (*shape, 3):
            raise InvalidRequestError(f"image {index} is {image.shape[1]}x{image.shape[0]}, not the batch's "
                                      f"{batch.width}x{batch.height}", param="image")
        images.append(image)
        mask = None if edit is None else edit.mask
        if mask is not None and mask.shape != shape:
            raise InvalidRequestError(f"mask {index} is {mask.shape[1]}x{mask.shape[0]}, not the image's "
                                      f"{batch.width}x{batch.height}", param="mask")
        masks.append(mask)
    pixels = np.stack(images).transpose(0, 3, 1, 2) / np.float32(255.0) * np.float32(2.0) - np.float32(1.0)
    if batch.mode == "txt2img":
        pixels = np.zeros_like(pixels)  # diffusers' image * (mask < 0.5) under a whole-image mask
    if all(m is None for m in masks) and not inpainting_unet:
        return EditInputs(pixels.astype(np.float32), None, None, None)
    full = np.full(shape, 255, np.uint8)
    raw = np.stack([full if m is None else m for m in masks])
    binary = (raw >= MASK_THRESHOLD).astype(np.float32)[:, None]
    paste = batch.overlay and batch.mode == "inpaint"
    originals = np.stack([s.edit.image for s in batch.images]) if paste else None  # type: ignore[union-attr]
    alpha = (raw.astype(np.float32) / 255.0)[..., None] if paste else None
    return EditInputs(pixels.astype(np.float32), binary, alpha, originals)


def paste_back(images: np.ndarray, inputs: EditInputs) -> np.ndarray:
    """A1111's overlay: the init image where the mask is 0, exactly; the generated one blended in by mask/255."""
    if inputs.overlay is None or inputs.originals is None:
        return images
    mixed = inputs.originals * (1.0 - inputs.overlay) + images * inputs.overlay
    return np.ascontiguousarray(np.clip(mixed.round(), 0, 255).astype(np.uint8))


def rows_of(inputs: EditInputs, start: int, stop: int) -> EditInputs:
    """The inputs of images ``start:stop`` of the batch (a decode of a few of them pastes back theirs)."""
    def part(array: np.ndarray | None) -> np.ndarray | None:
        return None if array is None else array[start:stop]

    return EditInputs(inputs.pixels[start:stop], part(inputs.mask), part(inputs.overlay), part(inputs.originals))


Run = Callable[[dict[str, ort.OrtValue | np.ndarray], dict[str, ort.OrtValue]], None]


@dataclass
class Mixer:
    """What an edit adds to every step: inpainting's blend (4-channel UNets) or the 9-channel UNet's extra input
    channels. ``after`` runs after each step's scheduler graph, on the step's output."""

    run: Run
    plan: SchedulePlan
    image: ort.OrtValue
    noise: ort.OrtValue
    keep: ort.OrtValue | np.ndarray
    blend: bool
    extra: ort.OrtValue | None

    def feeds(self, x: ort.OrtValue, ab: tuple[float, float], in_scale: float) -> dict[str, ort.OrtValue | np.ndarray]:
        feeds: dict[str, ort.OrtValue | np.ndarray] = {
            "x": x, "image": self.image, "noise": self.noise, "keep": self.keep,
            "ab": np.array(ab, dtype=STATE_DTYPE), "in_scale": np.array([in_scale], dtype=STATE_DTYPE)}
        if self.extra is not None:
            feeds["extra"] = self.extra
        return feeds

    def after(self, step: int, x: ort.OrtValue, out: ort.OrtValue, model_in: ort.OrtValue, in_scale: float) -> None:
        """Step ``step`` (of the sliced plan) wrote ``x``: write the blended latents into ``out`` and the next UNet
        input into ``model_in``. The blend noises the image to the next step's level (clean after the last)."""
        ab = self.plan.noising(step + 1) if self.blend else (0.0, 0.0)
        self.run(self.feeds(x, ab, in_scale), {"next": out, "model_in": model_in})


class Component(Protocol):
    """A session the editor runs (engines/pipelines/unet.py OrtModel)."""

    inputs: dict[str, Any]
    outputs: list[str]

    def input_dtype(self, name: str) -> type[np.generic]: ...
    def output_dtype(self, index: int = 0) -> type[np.generic]: ...
    def run(self, feeds: dict[str, ort.OrtValue | np.ndarray], outputs: dict[str, ort.OrtValue]) -> None: ...


class Buffers(Protocol):
    """Device buffers (engines/runtime/sessions.py Runtime)."""

    def buffer(self, tag: str, shape: tuple[int, ...], dtype: type[np.generic]) -> ort.OrtValue: ...
    def upload(self, tag: str, array: np.ndarray) -> ort.OrtValue: ...


@dataclass(frozen=True)
class Prepared:
    """An edit batch ready for the denoise loop."""

    start: ort.OrtValue
    """float32 latents at the first step."""
    model_in: ort.OrtValue
    """The first UNet input (the loop's UNet input buffer from then on)."""
    mixer: Mixer | None
    inputs: EditInputs


class Editor:
    """The VAE encoder and the edit graphs of one pipeline; every session is created at load (none on a request).
    ``make(model, name)`` creates a session under the runtime's policy."""

    def __init__(self, buffers: Buffers, encoder: Component, make: Callable[[bytes, str], Component],
                 scale: float, unet_in: type[np.generic], factor: int, inpainting: bool) -> None:
        self.buffers, self.encoder, self.factor, self.inpainting = buffers, encoder, factor, inpainting
        self.unet_in = unet_in
        self.sample = make(build_sample_graph(encoder.output_dtype(), scale), "latent_sample")
        self.mix = {copies: make(build_mix_graph(unet_in, copies, inpainting), f"edit_mix{copies}")
                    for copies in (1, 2)}
        self.extra = {copies: make(build_extra_graph(unet_in, copies), f"inpaint_extra{copies}")
                      for copies in ((1, 2) if inpainting else ())}

    def _encode(self, tag: str, pixels: np.ndarray, rngs: list[np.random.Generator],
                shape: tuple[int, ...]) -> ort.OrtValue:
        """Encode on the device and sample the latent distribution with each image's stream (scaled latents)."""
        name = next(iter(self.encoder.inputs))
        pix = self.buffers.upload(f"edit_{tag}_pixels", pixels.astype(self.encoder.input_dtype(name)))
        out = ENCODER_OUTPUT if ENCODER_OUTPUT in self.encoder.outputs else self.encoder.outputs[0]
        moments = self.buffers.buffer(f"edit_{tag}_moments", (shape[0], 2 * shape[1], *shape[2:]),
                                      self.encoder.output_dtype())
        self.encoder.run({name: pix}, {out: moments})
        eps = np.stack([r.standard_normal(shape[1:], dtype=np.float32) for r in rngs])
        latents = self.buffers.buffer(f"edit_{tag}_latents", shape, STATE_DTYPE)
        self.sample.run({"moments": moments, "eps": eps}, {"latents": latents})
        return latents

    def prepare(self, batch: Batch, plan: SchedulePlan, noise: np.ndarray, rngs: list[np.random.Generator],
                copies: int, strength_max: bool) -> Prepared:
        """Encode the batch's images, noise them to the plan's first step (pure noise for inpainting at strength
        1.0) and make the first UNet input; the mixer for every later step (inpainting)."""
        inputs = edit_inputs(batch, self.inpainting)
        shape = tuple(noise.shape)
        n, channels, h, w = shape
        f32 = STATE_DTYPE
        noise_dev = self.buffers.upload("edit_noise", noise.astype(f32))
        zeros = self.buffers.upload("edit_zeros", np.zeros(shape, f32))
        # diffusers encodes the image for a 4-channel UNet always (the blend needs it), else unless strength 1.0
        encode = not self.inpainting or not strength_max
        given = [s.edit.latents if s.edit is not None else None for s in batch.images]
        if all(g is not None for g in given):  # Hires fix's upscaled latents: nothing to encode
            image = self.buffers.upload("edit_given", self._given(given, shape))
        else:
            image = self._encode("image", inputs.pixels, rngs, shape) if encode else zeros
            if any(g is not None for g in given):  # a batch mixing given latents with images to encode
                rows = np.array(image.numpy(), dtype=f32)
                rows[[i for i, g in enumerate(given) if g is not None]] = self._given(
                    [g for g in given if g is not None], (0, *shape[1:]))
                image = self.buffers.upload("edit_given", rows)
        extra = None
        if self.inpainting and inputs.mask is not None:
            masked = self._encode("masked", inputs.pixels * (inputs.mask < 0.5), rngs, shape)
            extra = self.buffers.buffer("edit_extra", (copies * n, 1 + channels, h, w), self.unet_in)
            self.extra[copies].run({"mask": self._latent_mask(inputs.mask), "latents": masked}, {"extra": extra})
        pure = strength_max and inputs.mask is not None
        ab = (0.0, plan.init_noise_sigma) if pure else plan.noising(0)
        start = self.buffers.buffer("edit_start", shape, f32)
        unet_channels = channels + (1 + channels if extra is not None else 0)
        model_in = self.buffers.buffer("edit_unet_in", (copies * n, unet_channels, h, w), self.unet_in)
        if encode and inputs.mask is not None:
            image = self._fill(batch, inputs.mask, noise, image, Mixer(
                self.mix[copies].run, plan, zeros, zeros, np.ones((n, 1, h, w), f32), False, extra), model_in)
        mixer = Mixer(self.mix[copies].run, plan, image, noise_dev, np.zeros((n, 1, h, w), f32), False, extra)
        mixer.run(mixer.feeds(zeros, ab, plan.steps[0].input_scale), {"next": start, "model_in": model_in})
        if inputs.mask is None:  # img2img: no per-step work
            return Prepared(start, model_in, None, inputs)
        keep = np.ones((n, 1, h, w), f32) if self.inpainting else self._latent_mask(inputs.mask)
        return Prepared(start, model_in, Mixer(self.mix[copies].run, plan, image, noise_dev, keep,
                                               not self.inpainting, extra), inputs)

    @staticmethod
    def _given(latents: list[np.ndarray | None], shape: tuple[int, ...]) -> np.ndarray:
        """Given init latents stacked; each must have the batch's latent shape."""
        for index, array in enumerate(latents):
            if array is None or tuple(array.shape) != tuple(shape[1:]):
                raise InvalidRequestError(f"init latents {index} have shape {getattr(array, 'shape', None)}, not the "
                                          f"batch's {tuple(shape[1:])}", param="image")
        return np.ascontiguousarray(np.stack(latents), dtype=np.float32)  # type: ignore[arg-type]

    def _fill(self, batch: Batch, mask: np.ndarray, noise: np.ndarray, image: ort.OrtValue, mixer: Mixer,
              scratch: ort.OrtValue) -> ort.OrtValue:
        """A1111's inpainting_fill 2 (latent noise) and 3 (latent nothing): the masked part of each such image's
        init latents becomes its seeded start noise (A1111 draws it from a fresh generator of the same seed, which
        is the start noise) or zeros; the mix graph computes ``keep * image + (1 - keep) * source``."""
        fills = [s.edit.fill if s.edit is not None else "original" for s in batch.images]
        if all(f == "original" for f in fills):
            return image
        per_image = np.array([[f != "original", f == "noise"] for f in fills], np.float32)[:, :, None, None, None]
        keep = 1.0 - self._latent_mask(mask) * per_image[:, 0]
        source = self.buffers.upload("edit_fill_source", np.ascontiguousarray(noise * per_image[:, 1], np.float32))
        filled = self.buffers.buffer("edit_filled", tuple(noise.shape), STATE_DTYPE)
        fill = Mixer(mixer.run, mixer.plan, mixer.image, source, keep.astype(np.float32), False, mixer.extra)
        fill.run(fill.feeds(image, (0.0, 1.0), 1.0), {"next": filled, "model_in": scratch})
        return filled

    def _latent_mask(self, mask: np.ndarray) -> np.ndarray:
        """The binarized mask at latent resolution: every ``factor``-th pixel (torch's nearest interpolation)."""
        return np.ascontiguousarray(mask[:, :, ::self.factor, ::self.factor])
