"""The adapter library: the configured folder of LoRA files, scanned and checked against the served model.

Files are untrusted input. Only ``.safetensors`` is ever opened (a ``.ckpt``/``.pt``/``.bin``/``.pth`` is listed
as refused, never unpickled); a file resolving outside the folder (a symlink out) is refused; the header is checked
against size limits before its JSON is parsed (engines/lora/safetensors.py); every module must match a weight of the
served model with the same shape, or the file is refused naming the first one that does not (a SDXL LoRA on an
SD 1.5 model says which module and shape). A request names a LoRA by its name only; names are looked up in the
scanned index and never joined to a path, so ``../`` in a name finds nothing.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from engines.artifacts import sha256_file
from engines.lora import keys
from engines.lora.keys import DENOISER, LoraModule
from engines.lora.safetensors import Header, LoraFileError, read_header
from engines.lora.targets import Target, kohya_index

log = logging.getLogger(__name__)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
MAX_FILES = 10_000


@dataclass(frozen=True)
class Resolved:
    """One module of a LoRA file, matched to the served model's weight."""

    component: str
    """The session it changes: ``unet``, ``transformer``, ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``."""
    target: Target
    module: LoraModule


@dataclass(frozen=True)
class LoraFile:
    """One file of the library, usable or not (``problem`` says why not)."""

    name: str
    """The file name without its extension: what ``<lora:name:...>`` and the ``loras`` field name."""
    file: str
    """The path relative to the library folder."""
    size: int
    sha256: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    problem: str = ""
    resolved: tuple[Resolved, ...] = ()
    header: Header | None = None
    path: Path | None = None
    mtime_ns: int = 0
    """When the scan read it: a file changed since (size or mtime) is refused until the next scan."""

    @property
    def alias(self) -> str:
        return self.metadata.get("ss_output_name", self.name)

    @property
    def components(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.resolved:
            counts[r.component] = counts.get(r.component, 0) + 1
        return counts


ModelTargets = dict[str, dict[str, Target]]
"""Per session name (unet/transformer/text_encoder...), the targetable weights by normalized module path."""


def scan(folder: Path, targets: ModelTargets, family: str, max_header_bytes: int,
         max_file_bytes: int, layers_per_block: int = 2) -> dict[str, LoraFile]:
    """Every LoRA-looking file under ``folder``, by name (the first of two files with one name wins, the second
    is listed as refused)."""
    root = folder.resolve()
    found: dict[str, LoraFile] = {}
    files = sorted(p for p in root.rglob("*") if p.suffix.lower() in (".safetensors", *PICKLE_SUFFIXES))
    for path in files[:MAX_FILES]:
        entry = _entry(root, path, targets, family, max_header_bytes, max_file_bytes, layers_per_block)
        if entry.name in found:
            entry = LoraFile(entry.name, entry.file, entry.size, problem=(
                f"another file has the same name ({found[entry.name].file}); rename one"))
            found[f"{entry.name} ({entry.file})"] = entry
            continue
        found[entry.name] = entry
        if entry.problem:
            log.warning("LoRA %s refused: %s", entry.file, entry.problem)
    return found


def _entry(root: Path, path: Path, targets: ModelTargets, family: str, max_header_bytes: int,
           max_file_bytes: int, layers_per_block: int) -> LoraFile:
    relative = path.relative_to(root).as_posix()
    name = path.stem
    real = path.resolve()
    if not real.is_relative_to(root) or not real.is_file():
        return LoraFile(name, relative, 0, problem=f"{relative} resolves outside the LoRA folder (a link out of "
                        "it): refused")
    size = real.stat().st_size
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return LoraFile(name, relative, size, problem=f"{relative} is a pickle file ({path.suffix}): only "
                        ".safetensors LoRAs are loaded (unpickling runs code); convert it to safetensors")
    try:
        header = read_header(real, max_header_bytes, max_file_bytes)
        modules = keys.parse(relative, list(header.tensors))
        resolved = resolve(relative, modules, header, targets, family, layers_per_block)
    except LoraFileError as exc:
        return LoraFile(name, relative, size, problem=exc.message)
    stat = real.stat()
    return LoraFile(name, relative, size, sha256_file(real), dict(header.metadata), "", resolved, header, real,
                    stat.st_mtime_ns)


def resolve(file: str, modules: list[LoraModule], header: Header, targets: ModelTargets,
            family: str, layers_per_block: int = 2) -> tuple[Resolved, ...]:
    """Each module matched to a weight of the served model, shapes checked; LoraFileError names the first that
    matches nothing (with the family, since that is the usual cause). kohya's SDXL names in the original block
    layout (input_blocks/middle_block/output_blocks) are mapped with the UNet's ``layers_per_block``."""
    denoiser = "transformer" if "transformer" in targets else "unet"
    indexes = {name: kohya_index(weights) for name, weights in targets.items()}
    out = []
    for m in modules:
        component = denoiser if m.component == DENOISER else m.component
        weights = targets.get(component)
        if weights is None:
            raise LoraFileError(f"LoRA file {file} adapts {component}, which this {family} model does not have "
                                f"(its components: {', '.join(sorted(targets))}): a LoRA for another model family")
        target = _match(m, weights, indexes[component], layers_per_block if component == "unet" else None)
        if target is None:
            raise LoraFileError(f"LoRA file {file}: module {m.path} matches no weight of this {family} model's "
                                f"{component} (a LoRA for another model family, or a module this server cannot "
                                "adapt)")
        _check_shapes(file, m, header, target, family)
        out.append(Resolved(component, target, m))
    return tuple(out)


def _match(m: LoraModule, weights: dict[str, Target], index: dict[str, str],
           layers_per_block: int | None) -> Target | None:
    if m.kohya:
        name = keys.normalize_kohya(m.path)
        dotted = index.get(keys.sgm_to_diffusers(name, layers_per_block) if layers_per_block else name)
        return weights.get(dotted) if dotted is not None else None
    return weights.get(keys.normalize(m.path))


def _check_shapes(file: str, m: LoraModule, header: Header, target: Target, family: str) -> None:
    down, up = header.tensors[m.down].shape, header.tensors[m.up].shape
    out_features, in_features = target.out_in
    rank = down[0] if down else 0
    flat_down = math.prod(down[1:]) if len(down) > 1 else 0
    ok = (len(up) >= 2 and up[0] == out_features and math.prod(up[1:]) == rank and rank > 0
          and flat_down == in_features)
    if not ok:
        raise LoraFileError(f"LoRA file {file}: module {m.path} has factors up {list(up)} x down {list(down)}, "
                            f"but this {family} model's weight is {out_features} x {in_features} (a LoRA for another "
                            "model family or size)")
    if m.alpha is not None and header.tensors[m.alpha].shape not in ((), (1,)):
        raise LoraFileError(f"LoRA file {file}: module {m.path} has an alpha of shape "
                            f"{list(header.tensors[m.alpha].shape)}; alpha is one number")


