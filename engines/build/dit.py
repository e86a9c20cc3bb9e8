"""Tiny faithful flow-matching DiT models (Flux.1 dev/schnell, SD 3 / 3.5), built offline from a fixed seed, exported
to ONNX and saved as diffusers folders with the same weights. Build-time only: imports torch, diffusers and
transformers.

The transformer configs are the tiny ones diffusers' own tests use (tests/pipelines/flux, stable_diffusion_3 and
tests/models/transformers/test_models_transformer_sd3.py for SD 3.5's ``qk_norm`` and dual attention layers), with
the widths tied together the way the real models tie them: the VAE has 4 levels (scale factor 8) and 16 latent
channels with the real ``shift_factor``/``scaling_factor`` (Flux packs 2×2 of them into 64 transformer channels);
CLIP uses the real 49,408-token vocabulary (engines/build/clip_vocab.py); SD 3's CLIP-G is wider than CLIP-L and
the T5 wider than both, so the pipeline's zero-padding of the CLIP states to the T5 width is exercised; the T5 is a
v1.1-style gated-gelu encoder with an offline Unigram tokenizer (engines/build/t5_vocab.py).

engines/build/dit_export.py exports them (its docstring has the ONNX layout and the transformer's inputs).
"""

from __future__ import annotations

import functools
import json
import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engines.build.clip_vocab import clip_vocab, find_bpe_source, write_tokenizer
from engines.build.dit_export import export_dit, write_json
from engines.build.t5_vocab import t5_pieces, write_t5_tokenizer
from engines.errors import ConfigError

log = logging.getLogger(__name__)
SEED = 0
CLIP_L = dict(hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=5, vocab_size=49408,
              max_position_embeddings=77, hidden_act="quick_gelu", bos_token_id=49406, eos_token_id=49407,
              pad_token_id=49407, projection_dim=32)
CLIP_G = {**CLIP_L, "hidden_size": 48, "intermediate_size": 64, "hidden_act": "gelu", "projection_dim": 48,
          "pad_token_id": 0}
"""SD 3's OpenCLIP bigG stand-in: wider than CLIP-L, gelu, its tokenizer pads with ``!`` (id 0)."""
T5_WIDTH = 96
T5 = dict(d_model=T5_WIDTH, d_kv=8, d_ff=64, num_layers=2, num_heads=4, relative_attention_num_buckets=8,
          relative_attention_max_distance=16, feed_forward_proj="gated-gelu", dropout_rate=0.0,
          pad_token_id=0, eos_token_id=1, decoder_start_token_id=0, is_encoder_decoder=False, use_cache=False)
VAE16 = dict(block_out_channels=(32, 64, 64, 64), in_channels=3, out_channels=3, latent_channels=16,
             down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
             sample_size=64, norm_num_groups=32, use_quant_conv=False, use_post_quant_conv=False)
VAE_SCALING = {"flux": (0.3611, 0.1159), "sd3": (1.5035, 0.0609)}
"""(scaling_factor, shift_factor) of the real FLUX.1 and SD 3/3.5 VAEs."""
FLUX = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=1, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=T5_WIDTH, pooled_projection_dim=32, axes_dims_rope=(4, 4, 8))
SD3 = dict(sample_size=32, patch_size=2, in_channels=16, out_channels=16, num_layers=1, attention_head_dim=8,
           num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=T5_WIDTH,
           pooled_projection_dim=CLIP_L["projection_dim"] + CLIP_G["projection_dim"], pos_embed_max_size=96)
SD35 = {**SD3, "num_layers": 2, "dual_attention_layers": (0,), "qk_norm": "rms_norm"}
FLOW = dict(num_train_timesteps=1000, base_shift=0.5, max_shift=1.15, base_image_seq_len=256, max_image_seq_len=4096)
SCHEDULERS: dict[str, dict[str, Any]] = {
    "flux": {**FLOW, "shift": 3.0, "use_dynamic_shifting": True},
    "flux-schnell": {**FLOW, "shift": 1.0, "use_dynamic_shifting": False},
    "sd3": {**FLOW, "shift": 3.0, "use_dynamic_shifting": False},
}
"""As the released models' scheduler configs: dev shifts by resolution (mu), schnell not at all, SD 3/3.5 by 3.0."""


@dataclass(frozen=True)
class DitRecipe:
    """One DiT family's tiny build as data: the diffusers/transformers classes and configs of its modules, and
    whether it has SD 3's CLIP-G (the T5 then comes third: text_encoder_3 and tokenizer_3, not _2)."""

    pipeline: str
    """The diffusers pipeline class that saves the diffusers folder."""
    transformer: str
    transformer_config: dict[str, Any]
    scheduler: dict[str, Any]
    vae_scaling: tuple[float, float]
    """(scaling_factor, shift_factor) of the VAE."""
    text_encoder: str
    """The transformers class of CLIP-L (SD 3 pools its projection)."""
    clip_g: bool

    @property
    def t5_slot(self) -> str:
        """The T5's component suffix: after CLIP-L, and after CLIP-G where there is one."""
        return "_3" if self.clip_g else "_2"


RECIPES: dict[str, DitRecipe] = {
    "flux": DitRecipe("FluxPipeline", "FluxTransformer2DModel", {**FLUX, "guidance_embeds": True},
                      SCHEDULERS["flux"], VAE_SCALING["flux"], "CLIPTextModel", clip_g=False),
    "flux-schnell": DitRecipe("FluxPipeline", "FluxTransformer2DModel", {**FLUX, "guidance_embeds": False},
                              SCHEDULERS["flux-schnell"], VAE_SCALING["flux"], "CLIPTextModel", clip_g=False),
    "sd3": DitRecipe("StableDiffusion3Pipeline", "SD3Transformer2DModel", SD3, SCHEDULERS["sd3"], VAE_SCALING["sd3"],
                     "CLIPTextModelWithProjection", clip_g=True),
    "sd35": DitRecipe("StableDiffusion3Pipeline", "SD3Transformer2DModel", SD35, SCHEDULERS["sd3"],
                      VAE_SCALING["sd3"], "CLIPTextModelWithProjection", clip_g=True),
}
FAMILIES = tuple(RECIPES)


def dit_recipe(family: str) -> DitRecipe:
    """The recipe of ``family`` (one of FAMILIES); ValueError for any other name."""
    try:
        return RECIPES[family]
    except KeyError:
        raise ValueError(f"unknown DiT family {family!r}; expected one of {FAMILIES}") from None


def _seeded(seed: int, make: Any) -> Any:
    torch.manual_seed(seed)
    return make().eval()


def make_dit_components(family: str, seed: int = SEED, bpe: Path | None = None) -> dict[str, Any]:
    """Networks and scheduler of the tiny ``family`` (one of FAMILIES), each module from its own seed; ``bpe``: the
    CLIP merges source the T5 vocabulary is derived from (its size is the T5 embedding's)."""
    import diffusers
    import transformers
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    recipe = dit_recipe(family)
    scaling, shift = recipe.vae_scaling
    t5 = _seeded(seed + 2, lambda: T5EncoderModel(T5Config(vocab_size=t5_vocab_size(bpe), **T5)))
    parts: dict[str, Any] = {
        "vae": _seeded(seed + 3, lambda: AutoencoderKL(**VAE16, scaling_factor=scaling, shift_factor=shift)),
        "scheduler": FlowMatchEulerDiscreteScheduler(**recipe.scheduler),
    }
    clip_l = getattr(transformers, recipe.text_encoder)
    parts["text_encoder"] = _seeded(seed, lambda: clip_l(CLIPTextConfig(**CLIP_L)))
    if recipe.clip_g:
        parts["text_encoder_2"] = _seeded(seed + 1, lambda: CLIPTextModelWithProjection(CLIPTextConfig(**CLIP_G)))
    parts["text_encoder" + recipe.t5_slot] = t5
    transformer = getattr(diffusers, recipe.transformer)
    parts["transformer"] = _seeded(seed + 4, lambda: transformer(**recipe.transformer_config))
    return parts


@functools.lru_cache(maxsize=2)
def _clip_vocab(source: Path) -> dict[str, int]:
    return clip_vocab(source)[0]


def t5_vocab_size(bpe: Path | None = None) -> int:
    """The offline T5 tokenizer's size (the T5 embedding table's rows), from the CLIP merges it derives from."""
    return len(t5_pieces(_clip_vocab(find_bpe_source(bpe))))


def write_tokenizers(family: str, out: Path, bpe: Path | None = None) -> dict[str, Path]:
    """The family's tokenizer folders under ``out``: CLIP-L (pads with the end token), SD 3's CLIP-G (the same
    vocabulary, pads with ``!``) and the T5 (tokenizer_2 for Flux, tokenizer_3 for SD 3)."""
    source = find_bpe_source(bpe)
    dirs = {"tokenizer": out / "tokenizer"}
    write_tokenizer(source, dirs["tokenizer"])
    recipe = dit_recipe(family)
    if recipe.clip_g:
        dirs["tokenizer_2"] = out / "tokenizer_2"
        shutil.copytree(dirs["tokenizer"], dirs["tokenizer_2"])
        for name in ("special_tokens_map.json", "tokenizer_config.json"):
            path = dirs["tokenizer_2"] / name
            path.write_text(json.dumps({**json.loads(path.read_text(encoding="utf-8")), "pad_token": "!"},
                                       indent=2), encoding="utf-8")
    t5_name = "tokenizer" + recipe.t5_slot
    dirs[t5_name] = out / t5_name
    write_t5_tokenizer(_clip_vocab(source), dirs[t5_name], max_length=512)
    return dirs


def save_dit_diffusers(family: str, components: dict[str, Any], tokenizer_dirs: dict[str, Path], out: Path) -> Path:
    """The same weights as a diffusers folder (FluxPipeline / StableDiffusion3Pipeline) for parity and export. The
    tokenizer folders are copied in as written (transformers' CLIPTokenizer and T5Tokenizer read them), which
    spares loading the 49,408-entry vocabulary into transformers only to save it again."""
    import diffusers

    getattr(diffusers, dit_recipe(family).pipeline)(**components, **dict.fromkeys(tokenizer_dirs)).save_pretrained(out)
    index = json.loads((out / "model_index.json").read_text(encoding="utf-8"))
    for name, folder in tokenizer_dirs.items():
        config = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
        shutil.copytree(folder, out / name, dirs_exist_ok=True)
        index[name] = ["transformers", config["tokenizer_class"]]
    write_json(out / "model_index.json", index)
    return out


TINY_NATIVE_SIZE = 64
"""The tiny models' native size: canaries and the self-test run at 64x64 (seconds on a CPU), as for the tiny UNet."""


def _build_qwen(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool, first_block: bool,
                ) -> Path:
    from engines.build.qwen import build_tiny_qwen

    if first_block:
        raise ValueError("the first-block cache's transformer parts are not exported for Qwen-Image")
    return build_tiny_qwen(out, bpe, diffusers_out, vae_encoder)


def _build_flux2(distilled: bool) -> Callable[[Path, Path | None, Path | None, bool, bool], Path]:
    def build(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool, first_block: bool) -> Path:
        import importlib

        if first_block:
            raise ValueError("the first-block cache's transformer parts are not exported for FLUX.2")
        # with its VAE encoder: reference-image edits (engines/build/flux2_refs.py, named by string); else txt2img
        module, name = ("flux2_refs", "build_tiny_flux2_refs") if vae_encoder else ("flux2", "build_tiny_flux2")
        build: Callable[..., Path] = getattr(importlib.import_module(f"engines.build.{module}"), name)
        return build(out, bpe, diffusers_out, distilled)
    return build


OWN_BUILDERS: dict[str, Callable[[Path, Path | None, Path | None, bool, bool], Path]] = {
    "qwen-image": _build_qwen, "flux2-klein": _build_flux2(True), "flux2-klein-base": _build_flux2(False)}
"""The DiT families built by a module of their own, not from a recipe here: (out, bpe, diffusers_out, vae_encoder,
first_block) -> out."""


def _build_zimage(family: str) -> Callable[[Path, Path | None, Path | None, bool, bool], Path]:
    def build(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool, first_block: bool) -> Path:
        from engines.build.zimage import build_tiny_zimage

        return build_tiny_zimage(family, out, bpe, diffusers_out, vae_encoder, first_block)
    return build


OWN_BUILDERS.update({name: _build_zimage(name) for name in ("z-image-turbo", "z-image")})


def _build_kontext(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool,
                   first_block: bool) -> Path:
    """engines/build/kontext.py builds on this module's Flux.1 recipe, so it is named by string and loaded on use
    (as the architecture rows name their export modules), not imported back."""
    import importlib

    build: Callable[..., Path] = importlib.import_module("engines.build.kontext").build_tiny_kontext
    return build(out, bpe, diffusers_out, vae_encoder, first_block)


OWN_BUILDERS["flux-kontext"] = _build_kontext


def _build_qwen_edit(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool,
                     first_block: bool) -> Path:
    """Qwen-Image-Edit (engines/build/qwen_edit.py, named by string as Kontext is): with its VAE encoder, without
    first-block parts or a diffusers folder (its reference pipeline is built in memory)."""
    import importlib

    if first_block or not vae_encoder or diffusers_out is not None:
        raise ValueError("Qwen-Image-Edit is built with its VAE encoder, without first-block parts or a diffusers "
                         "folder")
    build: Callable[..., Path] = importlib.import_module("engines.build.qwen_edit").build_tiny_qwen_edit
    return build(out, bpe)


OWN_BUILDERS["qwen-image-edit"] = _build_qwen_edit


def _build_qwen_edit_2511(out: Path, bpe: Path | None) -> Path:
    """Qwen-Image-Edit-Plus 2511: the 2509 build with the transformer's ``zero_cond_t`` switched on."""
    import importlib

    build: Callable[..., Path] = importlib.import_module("engines.build.qwen_edit").build_tiny_qwen_edit
    return build(out, bpe, zero_cond_t=True)


VARIANTS: dict[tuple[str, str], Callable[[Path, Path | None], Path]] = {
    ("qwen-image-edit", "2511"): _build_qwen_edit_2511}
"""(family, variant) -> builder of a released configuration the family serves beside its first one, told apart by
its configs (``sdserve engines tiny --family F --variant V``)."""


def _build_flux2_dev(out: Path, bpe: Path | None, diffusers_out: Path | None, vae_encoder: bool,
                     first_block: bool) -> Path:
    """FLUX.2 [dev] (engines/build/mistral3.py, named by string): with its VAE encoder (reference images) unless
    ``vae_encoder`` is off; no first-block parts."""
    import importlib

    if first_block:
        raise ValueError("the first-block cache's transformer parts are not exported for FLUX.2")
    build: Callable[..., Path] = importlib.import_module("engines.build.mistral3").build_tiny_flux2_dev
    return build(out, bpe, diffusers_out, vae_encoder)


OWN_BUILDERS["flux2-dev"] = _build_flux2_dev


def build_tiny_dit(family: str, out: Path, bpe: Path | None = None, diffusers_out: Path | None = None,
                   vae_encoder: bool = True, first_block: bool = False, variant: str = "") -> Path:
    """Build the tiny ``family`` model and export it to ``out``; ``diffusers_out``: the same weights as a diffusers
    folder too; ``vae_encoder``: export the VAE encoder (edits) as well; ``first_block``: the transformer's parts
    for the first-block cache too (engines/build/dit_split.py); ``variant``: one of ``VARIANTS`` (built with its
    defaults only). Qwen-Image: engines/build/qwen.py."""
    if variant:
        chosen = VARIANTS.get((family, variant))
        if chosen is None or diffusers_out is not None or first_block:
            known = ", ".join(f"--family {f} --variant {v}" for f, v in VARIANTS) or "none"
            raise ConfigError(f"no tiny {family} variant {variant!r} with these options (variants: {known}; built "
                             "without --diffusers-out)")
        return chosen(out, bpe)
    own = OWN_BUILDERS.get(family)
    if own is not None:
        return own(out, bpe, diffusers_out, vae_encoder, first_block)
    components = make_dit_components(family, bpe=bpe)
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer_dirs = write_tokenizers(family, Path(tmp), bpe)
        export_dit(components, tokenizer_dirs, out, {"kind": "tiny", "family": family, "seed": SEED}, vae_encoder,
                   native_size=TINY_NATIVE_SIZE, first_block=first_block)
        if diffusers_out is not None:
            save_dit_diffusers(family, components, tokenizer_dirs, diffusers_out)
    log.info("tiny %s model in %s", family, out)
    return out
