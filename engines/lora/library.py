"""The adapter library: the configured folder of LoRA files, scanned and checked against the served model.

Files are untrusted input, and one bad file never takes the library down: whatever goes wrong with a file (a
symlink loop, a file removed mid-scan, a header nested too deep, an unreadable folder) makes it a refused entry,
listed with the reason, never a failed boot or a failed refresh. Only ``.safetensors`` is ever opened (a
``.ckpt``/``.pt``/``.bin``/``.pth`` is listed as refused, never unpickled); a file resolving outside the folder (a
symlink out) is refused, and every open checks again that the real path is inside the folder and opens it without
following a link (O_NOFOLLOW); the header is checked against size limits before its JSON is parsed
(engines/lora/safetensors.py); the values are checked (NaN, infinities) and the file hashed in the same read; every
module must match a weight of the served model with the same shape, or the file is refused naming the first one
that does not (a SDXL LoRA on an SD 1.5 model says which module and shape).

A request names a LoRA by its name (the file name without ``.safetensors``, NFC-normalized) or its alias (the
file's ``ss_output_name``); names are looked up in the scanned index and never joined to a path, so ``../`` in a
name finds nothing. A name with a control character (``\\r``, ``\\n``...) or bytes that are not UTF-8 is refused:
it could not travel in a header or an infotext. Scans are incremental: a file whose (device, inode, size, mtime,
ctime) did not change keeps its entry without being read again; a merge reads the file again through the same
checks and uses the bytes only if they hash to the scanned sha256 (``read_factors``).
"""

from __future__ import annotations

import logging
import math
import os
import stat
import unicodedata
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import BinaryIO

import numpy as np

from engines import families
from engines.lora import keys
from engines.lora.keys import DENOISER, LoraModule
from engines.lora.safetensors import (
    Header,
    LoraFileError,
    Stream,
    check_values,
    memory_bytes,
    read_header,
    read_tensors,
)
from engines.lora.targets import Target, kohya_index, pruned_sibling

log = logging.getLogger(__name__)
PICKLE_SUFFIXES = (".ckpt", ".pt", ".pth", ".bin")
SUFFIXES = (".safetensors", *PICKLE_SUFFIXES)
MAX_FILES = 10_000
MAX_ENTRIES = 200_000
"""Folder entries a scan looks at (files of any kind and folders): a bound on the walk of a huge tree."""
UNSAFE_CATEGORIES = ("Cc", "Zl", "Zp", "Cs")
"""Unicode categories a LoRA name may not hold: control characters, line/paragraph separators, lone surrogates
(bytes that are not UTF-8). Format characters (the zero-width joiner of emoji sequences) are fine."""
Fingerprint = tuple[int, int, int, int, int]
"""(device, inode, size, mtime_ns, ctime_ns): ctime moves on every write, even one that restores size and mtime."""


@dataclass(frozen=True)
class Resolved:
    """One module of a LoRA file, matched to the served model's weight."""

    component: str
    """The session it changes: ``unet``, ``transformer``, ``text_encoder``, ``text_encoder_2``, ``text_encoder_3``."""
    target: Target
    module: LoraModule
    rows: keys.Rows = ()
    """The rows of the module's up factor this weight takes (a fused projection of the original checkpoint
    layout split over diffusers' weights: engines/lora/keys.py ``renamed``); ``()``: all of them."""


@dataclass(frozen=True)
class LoraFile:
    """One file of the library, usable or not (``problem`` says why not)."""

    name: str
    """The file name without its extension (NFC): what ``<lora:name:...>`` and the ``loras`` field name."""
    file: str
    """The path relative to the library folder (non-UTF-8 bytes and control characters shown escaped)."""
    size: int
    sha256: str = ""
    metadata: dict[str, str] = field(default_factory=dict)
    problem: str = ""
    resolved: tuple[Resolved, ...] = ()
    header: Header | None = None
    path: Path | None = None
    """The real path the scan read (inside the folder)."""
    fingerprint: Fingerprint | None = None
    """The file as the scan read it; None for an entry a later scan must look at again."""

    @property
    def alias(self) -> str:
        """A1111's alias: the ``ss_output_name`` of the file's metadata (NFC), else the name; the name when the
        metadata's is not a usable name."""
        alias, problem = clean_name(self.metadata.get("ss_output_name", "").strip())
        return alias if alias and not problem else self.name

    @property
    def components(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for r in self.resolved:
            counts[r.component] = counts.get(r.component, 0) + 1
        return counts

    def factor_keys(self) -> list[str]:
        """The tensors a merge reads."""
        return [k for r in self.resolved for k in (r.module.down, r.module.up, r.module.alpha) if k]

    @property
    def factor_bytes(self) -> int:
        """Host bytes a merge holds while it reads this file's factors."""
        return memory_bytes(self.header, self.factor_keys()) if self.header is not None else 0


ModelTargets = dict[str, dict[str, Target]]
"""Per session name (unet/transformer/text_encoder...), the targetable weights by normalized module path."""


@dataclass(frozen=True)
class Limits:
    """What a scan holds a file to (from [runtime.lora])."""

    max_header_bytes: int
    max_file_bytes: int
    layers_per_block: int = 2


@dataclass
class Scan:
    """One scan's result: the library by name, and how much it had to read."""

    files: dict[str, LoraFile]
    read: int = 0
    """Files opened and hashed (new or changed since the previous scan)."""
    read_bytes: int = 0
    reused: int = 0
    """Files whose fingerprint was unchanged: their entry was kept without a read."""
    by_file: dict[str, LoraFile] = field(default_factory=dict)
    """Each entry by relative path, before same-name refusals: what the next scan may reuse."""


def clean_name(text: str) -> tuple[str, str]:
    """(the name NFC-normalized, or shown escaped; why it is refused, or ``""``)."""
    bad = next((c for c in text if unicodedata.category(c) in UNSAFE_CATEGORIES), None)
    if bad is None:
        return unicodedata.normalize("NFC", text), ""
    shown = display(text)
    if unicodedata.category(bad) == "Cs":
        return shown, f"its name \"{shown}\" holds bytes that are not UTF-8: rename the file"
    return shown, f"its name \"{shown}\" holds the control character U+{ord(bad):04X}: rename the file"


def display(text: str) -> str:
    """``text`` safe to show anywhere (JSON, logs, messages): undecodable bytes and control characters escaped."""
    decoded = text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return "".join(c if unicodedata.category(c) not in UNSAFE_CATEGORIES else f"\\u{ord(c):04x}" for c in decoded)


def scan(folder: Path, targets: ModelTargets, family: str, limits: Limits,
         previous: Mapping[str, LoraFile] | None = None) -> Scan:
    """Every LoRA-looking file under ``folder``, by name (the first of two files with one name wins, the second
    is listed as refused). ``previous`` (a former scan's ``by_file``): entries whose file is unchanged are kept
    without a read. Never raises for a file: each problem is an entry's ``problem``."""
    root = folder.resolve()
    result = Scan({})
    paths, unreadable = _walk(root)
    for entry in unreadable:
        result.files[f"{entry.name} ({entry.file})"] = entry
    for path in paths:
        entry = scan_file(root, path, targets, family, limits, previous or {}, result)
        result.by_file[entry.file] = entry
        if entry.name in result.files:
            entry = replace(entry, problem=f"another file has the same name ({result.files[entry.name].file}); "
                            "rename one", fingerprint=None)
            result.files[f"{entry.name} ({entry.file})"] = entry
        else:
            result.files[entry.name] = entry
        if entry.problem and entry is not (previous or {}).get(entry.file):
            log.warning("LoRA %s refused: %s", entry.file, entry.problem)
    return result


def _walk(root: Path) -> tuple[list[Path], list[LoraFile]]:
    """The candidate files (by suffix, sorted, at most MAX_FILES), folder links not followed (as ``rglob``); a
    folder that cannot be listed is a refused entry. Iterative: no recursion limit on a deep tree."""
    found: list[Path] = []
    unreadable: list[LoraFile] = []
    pending, seen = [root], 0
    while pending and seen < MAX_ENTRIES:
        folder = pending.pop()
        try:
            with os.scandir(folder) as it:
                entries = list(it)
        except OSError as exc:
            relative = display(folder.relative_to(root).as_posix())
            unreadable.append(LoraFile(relative, relative, 0, problem=f"the folder {relative} cannot be listed: "
                                       f"{exc.strerror or exc}"))
            continue
        seen += len(entries)
        for entry in entries:
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError:
                is_dir = False
            if is_dir:
                pending.append(Path(entry.path))
            elif entry.name.lower().endswith(SUFFIXES):
                found.append(Path(entry.path))
    if pending:
        log.warning("LoRA library: stopped after %d folder entries (MAX_ENTRIES); files further down are not "
                    "listed", seen)
    return sorted(found)[:MAX_FILES], unreadable


def scan_file(root: Path, path: Path, targets: ModelTargets, family: str, limits: Limits,
              previous: Mapping[str, LoraFile], counts: Scan | None = None) -> LoraFile:
    """One file's entry; any failure (OSError, a link loop, a hostile header) is the entry's ``problem``."""
    relative = display(path.relative_to(root).as_posix())
    name, problem = clean_name(path.name[: -len(path.suffix)] if path.suffix else path.name)
    if problem:
        return LoraFile(name, relative, 0, problem=f"{relative}: {problem}")
    if path.suffix.lower() in PICKLE_SUFFIXES:
        return LoraFile(name, relative, 0, problem=f"{relative} is a pickle file ({path.suffix}): only "
                        ".safetensors LoRAs are loaded (unpickling runs code); convert it to safetensors")
    try:
        return _read(root, path, name, relative, targets, family, limits, previous, counts or Scan({}))
    except LoraFileError as exc:
        return LoraFile(name, relative, 0, problem=exc.message)
    except OSError as exc:  # strerror only: the exception's text names the server's path
        return LoraFile(name, relative, 0, problem=f"{relative} cannot be read: {exc.strerror or 'I/O error'}")
    except RuntimeError:  # Path.resolve on a symlink loop (Python 3.11)
        return LoraFile(name, relative, 0, problem=f"{relative} cannot be read: a symlink loop")
    except Exception as exc:  # the contract is "never fails the boot": whatever else a hostile file triggers
        log.exception("LoRA %s: unexpected error while reading it", relative)
        return LoraFile(name, relative, 0, problem=f"{relative} cannot be read ({type(exc).__name__})")


def _read(root: Path, path: Path, name: str, relative: str, targets: ModelTargets, family: str, limits: Limits,
          previous: Mapping[str, LoraFile], counts: Scan) -> LoraFile:
    with open_inside(root, path, relative) as (f, real, st):
        fingerprint = _fingerprint(st)
        old = previous.get(relative)
        if old is not None and old.fingerprint == fingerprint and old.path == real and old.name == name:
            counts.reused += 1
            return old
        counts.read += 1
        counts.read_bytes += st.st_size
        try:
            stream = Stream(f, relative, st.st_size)
            header = read_header(stream, limits.max_header_bytes, limits.max_file_bytes)
            modules = keys.parse(relative, list(header.tensors))
            resolved = resolve(relative, modules, header, targets, family, limits.layers_per_block)
            check_values(stream, header)
            sha256 = stream.finish()
        except LoraFileError as exc:  # the same bytes give the same refusal: kept until the file changes
            return LoraFile(name, relative, st.st_size, problem=exc.message, path=real, fingerprint=fingerprint)
    return LoraFile(name, relative, st.st_size, sha256, dict(header.metadata), "", resolved, header, real,
                    fingerprint)


def _fingerprint(st: os.stat_result) -> Fingerprint:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


@contextmanager
def open_inside(root: Path, path: Path, relative: str) -> Iterator[tuple[BinaryIO, Path, os.stat_result]]:
    """``path`` opened for reading: its real path must be inside ``root``, its last component is opened without
    following a link (a file swapped for a symlink since it was resolved fails with ELOOP), the opened file must
    be a regular file (never a FIFO that blocks the read) and still be the one the real path names."""
    real = path.resolve(strict=True)
    if not real.is_relative_to(root):
        raise LoraFileError(f"{relative} resolves outside the LoRA folder (a link out of it): refused")
    fd = os.open(real, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
                 | getattr(os, "O_CLOEXEC", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise LoraFileError(f"{relative} is not a regular file: refused")
        named = os.stat(real, follow_symlinks=False)
        if (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
            raise LoraFileError(f"{relative} was replaced while being opened: refused until the next scan")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f, real, st


def read_factors(root: Path, file: LoraFile) -> dict[str, np.ndarray]:
    """The factors a merge needs, read through the scan's checks (inside the folder, no link followed) and used
    only if the file is the one the scan read: same fingerprint, and the bytes read hash to the scanned sha256.
    So a set is never merged from bytes other than those its hash names (a manifest attests what ran); a file
    changed or swapped since raises LoraFileError (the request gets a 400 naming ``loras``)."""
    if file.header is None or file.path is None:
        raise LoraFileError(f"LoRA {file.name!r} is refused: {file.problem}")
    changed = (f"LoRA file {file.file} changed on disk since the library was scanned: POST "
               "/sdapi/v1/refresh-loras to hash it again")
    try:
        with open_inside(root, file.path, file.file) as (f, _, st):
            if _fingerprint(st) != file.fingerprint:
                raise LoraFileError(changed)
            stream = Stream(f, file.file, st.st_size)
            tensors = read_tensors(stream, file.header, file.factor_keys())
            if stream.finish() != file.sha256:
                raise LoraFileError(changed)
    except OSError as exc:
        raise LoraFileError(f"{changed} ({exc.strerror or 'I/O error'})") from None
    except RuntimeError:
        raise LoraFileError(f"{changed} (a symlink loop)") from None
    except LoraFileError as exc:
        raise LoraFileError(changed if exc.message == changed else f"{changed} ({exc.message})") from None
    return tensors


def resolve(file: str, modules: list[LoraModule], header: Header, targets: ModelTargets,
            family: str, layers_per_block: int = 2) -> tuple[Resolved, ...]:
    """Each module matched to a weight of the served model, shapes checked; LoraFileError names the first that
    matches nothing (with the family, since that is the usual cause). kohya's SDXL names in the original block
    layout (input_blocks/middle_block/output_blocks) are mapped with the UNet's ``layers_per_block``."""
    denoiser = "transformer" if "transformer" in targets else "unet"
    indexes = {name: kohya_index(weights) for name, weights in targets.items()}
    out, inert = [], []
    for m in modules:
        component = denoiser if m.component == DENOISER else m.component
        weights = targets.get(component)
        if component.startswith("text_encoder") and any(part in _flat(m).lower() for part in T5_MODULES):
            raise LoraFileError(f"LoRA file {file} adapts {component}, {T5_LORA}")
        if weights is None:
            refused = text_encoder_lora_refused(family) if component.startswith("text_encoder") else ""
            raise LoraFileError(f"LoRA file {file} adapts {component}: {refused}" if refused else
                                f"LoRA file {file} adapts {component}, which this {family} model does not have "
                                f"(its components: {', '.join(sorted(targets))}): a LoRA for another model family")
        target = _match(m, weights, indexes[component], layers_per_block if component == "unet" else None)
        parts = _renamed(m, weights, indexes[component], family) if target is None else ()
        if parts:  # the architecture's original layout (FLUX.2's BFL names, Z-Image's fused qkv)
            for part, rows in parts:
                _check_shapes(file, m, header, part, family, rows)
                out.append(Resolved(component, part, m, rows))
            continue
        sibling = pruned_sibling(_flat(m), indexes[component]) if target is None else None
        if sibling is not None:  # checked against the same module of an earlier block, then left out
            _check_shapes(file, m, header, weights[sibling], family)
            inert.append(m.path)
            continue
        if target is None:
            raise LoraFileError(f"LoRA file {file}: module {m.path} matches no weight of this {family} model's "
                                f"{component} (a LoRA for another model family, or a module this server cannot "
                                "adapt)")
        _check_shapes(file, m, header, target, family)
        out.append(Resolved(component, target, m))
    if inert:
        log.info("LoRA file %s: %d modules adapt the last joint block's text stream, whose output this %s "
                 "transformer never reads (pruned from its graph): they change nothing and are not merged (%s)",
                 file, len(inert), family, ", ".join(inert))
    return tuple(out)


T5_MODULES = ("selfattention", "densereludense")
"""Module names only T5's encoder has (``encoder.block.N.layer.0.SelfAttention.q``, ``...DenseReluDense.wi``)."""
T5_LORA = ("a T5 text encoder: diffusers' LoRA loaders load none into T5 (FluxLoraLoaderMixin takes the transformer "
           "and CLIP, SD3LoraLoaderMixin the transformer and the two CLIPs), so the file is refused rather than served "
           "changing an image diffusers' pipeline leaves alone: remove the T5 keys from it")


def text_encoder_lora_refused(family: str) -> str:
    """Why the family's text encoders take no LoRA (engines/families.py ``lora_text_encoders``), or ``""``."""
    found = families.REGISTRY.get(family)
    return found.lora_text_encoders if found is not None else ""


def _flat(m: LoraModule) -> str:
    """The module's path in kohya's flat naming, whichever way the file names it."""
    return keys.normalize_kohya(m.path) if m.kohya else keys.kohya_name(m.path)


def _match(m: LoraModule, weights: dict[str, Target], index: dict[str, str],
           layers_per_block: int | None) -> Target | None:
    if m.kohya:
        name = keys.normalize_kohya(m.path)
        dotted = index.get(keys.sgm_to_diffusers(name, layers_per_block) if layers_per_block else name)
        return weights.get(dotted) if dotted is not None else None
    return weights.get(keys.normalize(m.path))


def _renamed(m: LoraModule, weights: dict[str, Target], index: dict[str, str],
             family: str) -> tuple[tuple[Target, keys.Rows], ...]:
    """The weights a module named in its architecture's original checkpoint layout adapts; ``()`` unless every
    one of them is in the graph."""
    found = families.REGISTRY.get(family)
    parts = keys.renamed(found.bases[0] if found is not None else family, _flat(m))
    dotted = [index.get(flat) for flat, _ in parts]
    if not parts or any(d is None or d not in weights for d in dotted):
        return ()
    return tuple((weights[d], rows) for d, (_, rows) in zip(dotted, parts, strict=True) if d is not None)


def _check_shapes(file: str, m: LoraModule, header: Header, target: Target, family: str,
                  rows: keys.Rows = ()) -> None:
    down, up = header.tensors[m.down].shape, header.tensors[m.up].shape
    out_features, in_features = target.out_in
    rank = down[0] if down else 0
    flat_down = math.prod(down[1:]) if len(down) > 1 else 0
    taken = up[0] if up else 0
    if rows and up:  # the chunks of the up factor's rows this weight takes: whole chunks, as many rows as it has
        taken = sum(up[0] // count for _, count in rows) if all(up[0] % count == 0 for _, count in rows) else -1
    ok = (len(up) >= 2 and taken == out_features and math.prod(up[1:]) == rank and rank > 0
          and flat_down == in_features)
    if not ok:
        raise LoraFileError(f"LoRA file {file}: module {m.path} has factors up {list(up)} x down {list(down)}, "
                            f"but this {family} model's weight is {out_features} x {in_features} (a LoRA for another "
                            "model family or size)")
    if m.alpha is not None and header.tensors[m.alpha].shape not in ((), (1,)):
        raise LoraFileError(f"LoRA file {file}: module {m.path} has an alpha of shape "
                            f"{list(header.tensors[m.alpha].shape)}; alpha is one number")


