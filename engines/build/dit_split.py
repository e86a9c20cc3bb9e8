"""The DiT transformer exported in parts for the first-block cache (engines/pipelines/first_block.py), split where
diffusers' ``apply_first_block_cache`` (diffusers/hooks/first_block_cache.py) splits it. Build-time only: imports
torch and diffusers.

The hook takes the transformer's block lists in module order (``transformer_blocks``, then Flux's
``single_transformer_blocks``): the first block is the *head*, every later block the *remaining blocks*, the last of
them the *tail*. Its decision reads the head's hidden-state residual (block output minus block input, image tokens
only); a computed step caches the tail residual (tail output minus head output, hidden states); a skipped step adds
that cached residual to the head's output and lets every remaining block pass its input through, so the model's
output is its head (norm_out, proj_out; SD 3 also unpatchifies) applied to ``head output + tail residual``. The
hook caches an encoder-state tail residual too, but nothing after the last block reads encoder states (Flux's and
SD 3's heads take the image tokens only), so no part computes it.

Parts (each ``<part>/model.onnx``; names in engines/pipelines/first_block.py ``PARTS``):

- ``transformer_first``: the full transformer's inputs -> ``first_hidden_states``, ``first_encoder_hidden_states``
  (after the head block), ``temb`` (the embedded timestep, guidance and pooled text) and ``first_residual``.
- ``transformer_rest``: ``first_hidden_states``, ``first_encoder_hidden_states``, ``temb`` (Flux: + ``rope_cos``,
  ``rope_sin``; SD 3: + ``hidden_states``, read for its height and width only) -> ``out_hidden_states`` and
  ``tail_residual``.
- ``transformer_skip``: ``first_hidden_states``, ``tail_residual``, ``temb`` (SD 3: + ``hidden_states``) ->
  ``out_hidden_states``.

The forward passes below restate diffusers' ``FluxTransformer2DModel.forward`` and ``SD3Transformer2DModel.forward``
(0.42) around their own embedding, block and head modules, without the paths the served graph never takes
(ControlNet residuals, IP-Adapter, SD 3's ``skip_layers``). Half precision goes through dit_export's ``_io`` as the
full transformer does: the parts' inputs and outputs are fp32 (casts inside), so a half value crossing from one part
to the next is rounded nowhere.

Disk: ``first`` + ``rest`` hold the transformer's weights once more (the head's ``norm_out``/``proj_out`` a third
time, in ``skip``), beside ``transformer/`` (which the pipeline still loads for uncached requests, LoRA and joined
step batches), so the parts are written only on request (``export_dit(first_block=True)``, ``sdserve engines export
--first-block``). External data cannot share them across the sibling folders: ONNX Runtime 1.31 refuses an
external-data location outside the model's own folder, ``..`` and symbolic links alike ("External data path escapes
model directory"); only a hard link, which copies and archives do not keep, passes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engines.pipelines.first_block import FIRST, MID, REST, SKIP


def _blocks(model: Any) -> list[torch.nn.Module]:
    """The hook's block order: joint blocks, then Flux's single-stream blocks."""
    return [*model.transformer_blocks, *getattr(model, "single_transformer_blocks", [])]


def splittable(model: Any) -> bool:
    """The hook needs a head and a tail: two blocks at least (SD 3 with one layer has none to skip)."""
    return len(_blocks(model)) >= 2


class _Part(torch.nn.Module):
    """Holds the network as ``model`` (node names keep their ``/model/...`` scope, as the full export's)."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.model = model
        self.flux = hasattr(model, "single_transformer_blocks")

    def block(self, block: torch.nn.Module, hidden: torch.Tensor, encoder: torch.Tensor, temb: torch.Tensor,
              rope: tuple[torch.Tensor, torch.Tensor] | None) -> tuple[torch.Tensor, torch.Tensor]:
        extra = {"image_rotary_emb": rope} if self.flux else {}
        encoder_out, hidden_out = block(hidden_states=hidden, encoder_hidden_states=encoder, temb=temb, **extra)
        return hidden_out, encoder_out

    def head(self, hidden: torch.Tensor, temb: torch.Tensor, latents: torch.Tensor | None) -> torch.Tensor:
        """norm_out and proj_out; SD 3 unpatchifies to the latents' [B, C, H, W] (its forward's tail)."""
        m = self.model
        out = m.proj_out(m.norm_out(hidden, temb))
        if latents is None:
            return out
        p = int(m.config.patch_size)
        height, width = latents.shape[-2] // p, latents.shape[-1] // p
        out = out.reshape(out.shape[0], height, width, p, p, m.out_channels)
        out = torch.einsum("nhwpqc->nchpwq", out)
        return out.reshape(out.shape[0], m.out_channels, height * p, width * p)


class _First(_Part):
    def forward(self, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor, pooled: torch.Tensor,
                timestep: torch.Tensor, *rest: torch.Tensor) -> tuple[torch.Tensor, ...]:
        m = self.model
        rope: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.flux:  # FluxTransformer2DModel.forward's embeddings; the rope tables arrive as inputs
            hidden = m.x_embedder(hidden_states)
            timestep = timestep.to(hidden.dtype) * 1000
            guidance = rest[2].to(hidden.dtype) * 1000 if len(rest) > 2 else None
            temb = m.time_text_embed(timestep, pooled) if guidance is None else \
                m.time_text_embed(timestep, guidance, pooled)
            rope = (rest[0], rest[1])
        else:  # SD3Transformer2DModel.forward's
            hidden = m.pos_embed(hidden_states).contiguous()
            temb = m.time_text_embed(timestep, pooled)
        encoder = m.context_embedder(encoder_hidden_states)
        first, first_encoder = self.block(_blocks(m)[0], hidden, encoder, temb, rope)
        return first, first_encoder, temb, first - hidden


class _Rest(_Part):
    def forward(self, first: torch.Tensor, first_encoder: torch.Tensor, temb: torch.Tensor,
                *rest: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rope = (rest[0], rest[1]) if self.flux else None
        hidden, encoder = first, first_encoder
        for block in _blocks(self.model)[1:]:
            hidden, encoder = self.block(block, hidden, encoder, temb, rope)
        return self.head(hidden, temb, None if self.flux else rest[0]), hidden - first


class _Skip(_Part):
    def forward(self, first: torch.Tensor, tail_residual: torch.Tensor, temb: torch.Tensor,
                *latents: torch.Tensor) -> torch.Tensor:
        return self.head(tail_residual + first, temb, latents[0] if latents else None)


def _example(model: Any, flux: bool) -> tuple[list[torch.Tensor], list[str]]:
    """The full transformer's example inputs and names (as dit_export's ``_export_transformer``)."""
    config = model.config
    text = torch.randn(1, 8, int(config.joint_attention_dim))
    pooled = torch.randn(1, int(config.pooled_projection_dim))
    if not flux:
        return [torch.randn(1, int(config.in_channels), 8, 8), text, pooled, torch.tensor([500.0])], \
            ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep"]
    head = int(config.attention_head_dim)
    args = [torch.randn(1, 16, int(config.in_channels)), text, pooled, torch.tensor([0.5]), torch.randn(24, head),
            torch.randn(24, head)]
    names = ["hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "rope_cos", "rope_sin"]
    if config.guidance_embeds:
        args.append(torch.tensor([3.5]))
        names.append("guidance")
    return args, names


def _dynamic(flux: bool, names: list[str]) -> dict[str, dict[int, str]]:
    image = {0: "batch", 1: "image_tokens"}
    spatial = {0: "batch", 2: "height", 3: "width"}
    axes: dict[str, dict[int, str]] = {
        "hidden_states": image if flux else spatial, "encoder_hidden_states": {0: "batch", 1: "text_tokens"},
        "pooled_projections": {0: "batch"}, "timestep": {0: "batch"}, "guidance": {0: "batch"},
        "rope_cos": {0: "tokens"}, "rope_sin": {0: "tokens"}, "first_hidden_states": image,
        "first_encoder_hidden_states": {0: "batch", 1: "text_tokens"}, "temb": {0: "batch"},
        "first_residual": image, "tail_residual": image, "out_hidden_states": image if flux else spatial}
    return {n: axes[n] for n in names}


@dataclass(frozen=True)
class Part:
    """One part to export: its folder, the module (the network under ``model``), example inputs, IO names, the
    input positions kept fp32 at half precision (Flux's rope tables) and the dynamic axes."""

    folder: str
    module: torch.nn.Module
    args: tuple[torch.Tensor, ...]
    inputs: list[str]
    outputs: list[str]
    fp32_inputs: tuple[int, ...]
    dynamic: dict[str, dict[int, str]]


def first_block_parts(transformer: Any, flux: bool) -> list[Part]:
    """``transformer_first``, ``transformer_rest`` and ``transformer_skip`` (the module docstring), ready for
    dit_export's exporter; the later parts' example inputs are the first part's outputs."""
    if not splittable(transformer):
        raise ValueError(f"the transformer has {len(_blocks(transformer))} block(s): nothing after the first to skip")
    args, names = _example(transformer, flux)
    rope = (4, 5) if flux else ()
    dtype = next(transformer.parameters()).dtype  # run as the half graphs' edge casts will feed it
    cast = [a.to(dtype) if a.is_floating_point() and i not in rope else a for i, a in enumerate(args)]
    with torch.no_grad():
        first, first_encoder, temb = (t.float() for t in _First(transformer)(*cast)[:3])
    mid, mid_names = [first, first_encoder, temb], list(MID)
    extra, extra_names = (args[4:6], names[4:6]) if flux else ([args[0]], ["hidden_states"])
    latents, latent_names = ([], []) if flux else ([args[0]], ["hidden_states"])
    specs: list[tuple[str, type[_Part], list[torch.Tensor], list[str], list[str], tuple[int, ...]]] = [
        (FIRST, _First, args, names, [*mid_names, "first_residual"], rope),
        (REST, _Rest, mid + extra, mid_names + extra_names, ["out_hidden_states", "tail_residual"],
         (3, 4) if flux else ()),
        (SKIP, _Skip, [first, torch.zeros_like(first), temb, *latents],
         ["first_hidden_states", "tail_residual", "temb", *latent_names], ["out_hidden_states"], ())]
    return [Part(folder, kind(transformer), tuple(inputs), input_names, outputs, fp32,
                 _dynamic(flux, input_names + outputs))
            for folder, kind, inputs, input_names, outputs, fp32 in specs]
