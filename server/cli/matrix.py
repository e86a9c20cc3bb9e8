"""The support matrix, generated: every family the code knows x every shipped profile, each cell's status found by
running the code on that family's tiny model. `make refs` (python -m server.cli.refs) rewrites the block between
``<!-- support-matrix:start -->`` and ``<!-- support-matrix:end -->`` in README.md and docs/index.md;
tests/integration/test_support_matrix.py regenerates it and fails when a committed block differs.

Rows: the families ``sdserve engines tiny --family`` builds (every registered family and the inpainting UNet).
Columns: the profiles in configs/. Each tiny model is built by that command, then each cell is asked of the code
itself, through the same entry points an operator uses:

- a TensorRT profile (production): ``sdserve engines build --profile P --model <tiny> --dry-run``, in process: the
  TensorRT plan (engines/build/trtplan.py, trtplan_dit.py) and ORT's parser on every option set of it;
- a plugin-EP profile (openvino): the same dry run, the EP-context plan (engines/build/epctx.py);
- a CPU profile (dev): the engine's preflight and load under the profile's policy;
- a CUDA-only profile (cuda): no per-size build, so no plan to print; the graphs it serves are the ones the CPU
  column's load reads (optimized with ``engines optimize --target cuda``), so a family the engine does not load
  there is "not built" here too.

A command that raises is "not built", with its reason; nothing else decides that. Above "built", the evidence:
"proven on CPU" where ``PROOFS`` in tests/integration/test_support_matrix.py names the suite's tests that serve
the family on that profile (a test there checks each named test exists; the registry lives beside the tests
because server/ never names a family: tests/unit/test_layout.py), and "proven on a GPU" only where a recorded
GPU run passed (``GPU_RUNS``: an ``sdserve accept`` report with ``family`` and ``profile`` added). A profile
that needs a GPU (production) cannot be proven on a CPU: its ``PROOFS`` entries are notes on what the suite checks
without one.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import engines.families as families
from engines.factory import create_engine
from engines.types.model import ModelInfo
from server.cli.engines import run
from server.settings import PROFILES, load_settings

ROOT = Path(__file__).resolve().parents[2]
START, END = "<!-- support-matrix:start -->", "<!-- support-matrix:end -->"
PAGES = {"README.md": "docs/", "docs/index.md": ""}
"""Files holding the block -> the prefix their links to docs/ take."""
PROOFS_FILE = Path("tests/integration/test_support_matrix.py")
GPU_RUNS = Path("benchmarks/results/gpu")
"""Recorded GPU runs, one JSON file each: ``family``, ``profile``, ``verdict.status`` ("pass") and ``node`` (the
GPU's facts), as ``sdserve accept`` writes its report plus the two keys. None is recorded yet."""
LEVELS = ("not built", "built", "proven on CPU", "proven on a GPU")
MODES = {"txt2img": "txt2img", "img2img": "img2img", "inpaint": "inpainting"}
"""ModelInfo.modes -> the words the APIs column uses."""
Proofs = Mapping[tuple[str, str], tuple[tuple[str, str], ...]]
"""(family, profile) -> ((test node id, what it shows), ...)."""


@dataclass(frozen=True)
class Column:
    """One shipped profile and how its cells are asked: ``cpu`` (load), ``plugin`` or ``tensorrt`` (dry run),
    ``cuda`` (the CPU column's load: the same graphs, no per-size build)."""

    profile: str
    kind: str
    header: str

    @property
    def on_cpu(self) -> bool:
        """Whether the suite can run this profile on a CPU (a GPU profile's best is "built")."""
        return self.kind not in ("tensorrt", "cuda")


@dataclass(frozen=True)
class Cell:
    """One family on one profile: its level (``LEVELS``), how that is known, and what it covers."""

    level: str
    how: str = ""
    detail: str = ""

    def render(self) -> str:
        how = f" ({self.how})" if self.how else ""
        return f"**{self.level}**{how}: {self.detail}" if self.detail else f"**{self.level}**{how}"


@dataclass(frozen=True)
class Row:
    family: str
    label: str
    apis: str
    cells: tuple[Cell, ...]


# ---- rows and columns ---------------------------------------------------------------------------------------------

def _cli() -> argparse.ArgumentParser:
    from server.cli.main import parser

    return parser()


def _subparser(p: argparse.ArgumentParser, *path: str) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction))
        p = action.choices[name]
    return p


def family_names() -> tuple[str, ...]:
    """What ``sdserve engines tiny --family`` builds, in its order: the families the code knows."""
    tiny = _subparser(_cli(), "engines", "tiny")
    action = next(a for a in tiny._actions if "--family" in a.option_strings)
    return tuple(str(c) for c in action.choices or ())


def columns() -> list[Column]:
    """The shipped profiles, the CPU-runnable ones first (configs/<profile>.toml)."""
    found = []
    for profile in PROFILES:
        runtime = load_settings(profile).runtime
        if runtime.plugin is not None:
            found.append(Column(profile, "plugin", f"`{runtime.plugin.name}` plugin EP on the "
                                                   f"{runtime.plugin.device_type} (`{profile}` profile)"))
        elif "TensorrtExecutionProvider" in runtime.providers:
            names = " + ".join(f"`{p}`" for p in runtime.providers)
            found.append(Column(profile, "tensorrt", f"{names} (`{profile}` profile)"))
        elif runtime.allow_cpu:
            found.append(Column(profile, "cpu", f"CPU (`{profile}` profile, not accelerated)"))
        elif tuple(runtime.providers) == ("CUDAExecutionProvider",):
            found.append(Column(profile, "cuda", f"`CUDAExecutionProvider` alone (`{profile}` profile)"))
        else:
            raise ValueError(f"profile {profile}: no way to ask its plan (neither a plugin, TensorRT, CUDA alone "
                             "nor the CPU)")
    return sorted(found, key=lambda c: not c.on_cpu)


def tiny_folders(root: Path, names: tuple[str, ...]) -> dict[str, Path]:
    """Each family's tiny model, built by ``sdserve engines tiny`` under ``root``."""
    for name in names:
        run(_cli().parse_args(["engines", "tiny", "--family", name, "--out", str(root / name)]))
    return {name: root / name for name in names}


# ---- asking the code ----------------------------------------------------------------------------------------------

def _reason(exc: Exception, folder: Path) -> str:
    text = " ".join(str(exc).replace(str(folder), "the tiny model").split())
    return f"{type(exc).__name__}: {text}".replace("|", "\\|")


def dry_run(folder: Path, profile: str) -> dict[str, Any]:
    """``sdserve engines build --profile P --model F --dry-run``, in process: the plan it prints."""
    out = io.StringIO()
    args = _cli().parse_args(["engines", "build", "--profile", profile, "--model", str(folder), "--dry-run"])
    with contextlib.redirect_stdout(out):
        run(args)
    printed: dict[str, Any] = json.loads(out.getvalue())
    return printed


def load_info(folder: Path, profile: str) -> ModelInfo:
    """The engine's preflight and load under the profile's policy; what it then serves."""
    engine = create_engine(folder, load_settings(profile).runtime)
    try:
        engine.preflight()
        engine.load()
        return engine.info
    finally:
        engine.close()


def _by_precision(printed: dict[str, Any]) -> str:
    flags = printed["build_flags"]
    precision, upcast = flags.get("precision") or {}, set(flags.get("fp32_components", ()))
    groups: dict[str, list[str]] = {}
    for component in next(iter(printed["sizes"].values()))["components"]:
        half = "fp16" if flags.get("fp16") else "fp32"
        groups.setdefault(precision.get(component) or ("fp32" if component in upcast else half), []).append(component)
    return ", ".join(f"{p} ({', '.join(c)})" for p, c in groups.items())


def planned(folder: Path, column: Column, loaded: ModelInfo | None = None) -> tuple[Cell, ModelInfo | None]:
    """The cell as the code answers it ("built" or "not built"), and the served model's info for a CPU profile.
    ``loaded``: what a CPU column's load served (a CUDA-only column's cell follows it)."""
    if column.kind == "cuda":
        if loaded is None:
            return Cell("not built", "", "the engine does not load these graphs (see the CPU column)"), None
        return Cell("built", "no per-size build, no run",
                    "the graphs the CPU column loads, at every size within the limits "
                    "(`engines optimize --target cuda`)"), None
    try:
        if column.kind == "cpu":
            info = load_info(folder, column.profile)
            return Cell("built", f"the engine loads it under the `{column.profile}` policy", "no test serves it"), info
        printed = dry_run(folder, column.profile)
    except Exception as exc:  # whatever the code raises is the reason the cell is not built
        return Cell("not built", "", _reason(exc, folder)), None
    sizes = ", ".join(printed["sizes"])
    if column.kind == "plugin":
        parts = ", ".join(next(iter(printed["sizes"].values())))
        return Cell("built", "planned, no run", f"an EP-context model per component at {sizes} ({parts})"), None
    return Cell("built", f"planned, {len(printed['option_parser'])} option sets through ORT's parser, no run",
                f"TensorRT engines at {sizes} in {_by_precision(printed)}"), None


# ---- evidence -----------------------------------------------------------------------------------------------------

def proofs(root: Path = ROOT) -> dict[tuple[str, str], tuple[tuple[str, str], ...]]:
    """``PROOFS`` of tests/integration/test_support_matrix.py, read as a literal (the test module is never imported)."""
    tree = ast.parse((root / PROOFS_FILE).read_text(encoding="utf-8"))
    for node in tree.body:
        pairs: list[tuple[ast.expr, ast.expr | None]]
        if isinstance(node, ast.AnnAssign):
            pairs = [(node.target, node.value)]
        elif isinstance(node, ast.Assign):
            pairs = [(target, node.value) for target in node.targets]
        else:
            continue
        for target, value in pairs:
            if isinstance(target, ast.Name) and target.id == "PROOFS" and value is not None:
                found: dict[tuple[str, str], tuple[tuple[str, str], ...]] = ast.literal_eval(value)
                return found
    raise ValueError(f"{PROOFS_FILE} defines no PROOFS literal")


def gpu_runs(root: Path = ROOT) -> dict[tuple[str, str], str]:
    """(family, profile) -> the GPU it passed on, from the recorded runs (``GPU_RUNS``)."""
    runs: dict[tuple[str, str], str] = {}
    for path in sorted((root / GPU_RUNS).glob("*.json")):
        record = json.loads(path.read_text(encoding="utf-8"))
        if record.get("verdict", {}).get("status") == "pass":
            gpu = record.get("node", {}).get("gpu") or "a GPU"
            runs[(str(record["family"]), str(record["profile"]))] = f"{gpu} (`{GPU_RUNS.as_posix()}/{path.name}`)"
    return runs


def evidence(family: str, column: Column, cell: Cell, shown: Proofs, runs: Mapping[tuple[str, str], str]) -> Cell:
    """The planned cell raised to what the suite and the recorded GPU runs prove; a cell the code does not plan
    stays "not built" whatever is recorded."""
    if cell.level == "not built":
        return cell
    key = (family, column.profile)
    notes = "; ".join(what for _, what in shown.get(key, ()))
    if key in runs:
        return Cell("proven on a GPU", "a recorded run", runs[key])
    if notes and column.on_cpu:
        return Cell("proven on CPU", "`make test`", notes)
    if notes:
        return Cell(cell.level, cell.how, f"{cell.detail}; checked without a GPU: {notes}")
    return cell


# ---- the block ----------------------------------------------------------------------------------------------------

def label(family: str, info: ModelInfo | None) -> str:
    if family in families.REGISTRY:
        return f"`{family}`: {families.facts(family).description}"
    if info is not None and info.family in families.REGISTRY:
        kind = "inpainting UNet" if info.inpainting_unet else "variant"
        return f"`{family}`: {kind} of {families.facts(info.family).description}"
    return f"`{family}`"


def apis(info: ModelInfo | None) -> str:
    """What the loaded model serves through both APIs (its ModelInfo: modes and samplers)."""
    if info is None:
        return "not served"
    routes = "OpenAI generations; A1111 txt2img" if "img2img" not in info.modes else \
        "OpenAI generations, edits, variations; A1111 txt2img, img2img"
    edits = [MODES[m] for m in MODES if m in info.modes and m != "txt2img"]
    missing = [MODES[m] for m in MODES if m not in info.modes]
    text = routes + (f"; edits: {' and '.join(edits)}" if edits else "") + (
        f" (no {', '.join(missing)})" if missing else "")
    if info.inpainting_unet:
        text += "; the 9-channel UNet serves txt2img as A1111 does"
    if families.facts(info.family).openai_sizes:
        text += "; OpenAI's 1024 sizes with `[serving] openai_sizes`"
    if len(info.schedulers) == 1:
        return f"{text}; sampler `{info.schedulers[0]}` only"
    return f"{text}; {len(info.schedulers)} samplers ({len(info.edit_schedulers)} for edits)"


def rows(folders: Mapping[str, Path], cols: list[Column], shown: Proofs,
         runs: Mapping[tuple[str, str], str]) -> list[Row]:
    found = []
    for family, folder in folders.items():
        cells, info = [], None
        for column in cols:
            cell, served = planned(folder, column, info)
            info = info or served
            cells.append(evidence(family, column, cell, shown, runs))
        found.append(Row(family, label(family, info), apis(info), tuple(cells)))
    return found


FOOTER = """Generated by `make refs` from what the code does with each family's tiny model (`sdserve engines tiny`):
a TensorRT or plugin-EP cell is the plan `sdserve engines build --dry-run` prints (one that raises is **not built**),
a CPU cell the engine's load under that profile, a CUDA-only cell that load's graphs (no per-size build);
**proven on CPU** cites tests of `make test` (registered in `PROOFS`,
`tests/integration/test_support_matrix.py`); **proven on a GPU** needs a recorded GPU run.
GPU runs recorded: {recorded}.
Refused at boot (exit 11, naming what was found): other pipeline classes (FLUX.2 [klein] inpainting, Kontext
inpainting, the Flux tools, the first Qwen-Image-Edit, ...), depth and upscaler UNets, LCM, SDXL refiners; ControlNets
are served beside an SD 1.x, SDXL or FLUX.1 model (`--controlnet-dir`), not as a model. On a GPU node,
`sdserve accept --out report/` proves the fast path and writes the numbers
([the GPU path]({docs}gpu-path.md#acceptance-on-a-gpu-node-sdserve-accept))."""


def block(found: list[Row], cols: list[Column], docs: str) -> str:
    """The Markdown between the markers; ``docs``: the prefix of links into docs/ from the page it goes in."""
    header = ("family", *(c.header for c in cols), "APIs")
    lines = [f"| {' | '.join(header)} |", f"|{'---|' * len(header)}"]
    lines += [f"| {' | '.join((r.label, *(c.render() for c in r.cells), r.apis))} |" for r in found]
    gpu = sum(c.level == LEVELS[-1] for r in found for c in r.cells)
    recorded = f"{gpu} of the cells above (`{GPU_RUNS.as_posix()}/`)" if gpu else "none yet, the one thing missing"
    return "\n".join([START, *lines, "", FOOTER.format(recorded=recorded, docs=docs), END])


def rewrite(text: str, new_block: str, name: str) -> str:
    """``text`` with its one marked block replaced; ValueError when the markers are not there exactly once."""
    if text.count(START) != 1 or text.count(END) != 1 or text.index(START) > text.index(END):
        raise ValueError(f"{name} must hold {START} ... {END} exactly once")
    return text[:text.index(START)] + new_block + text[text.index(END) + len(END):]


def generate(folders: Mapping[str, Path] | None = None, root: Path = ROOT) -> dict[Path, str]:
    """Each page holding the block -> its text with the block regenerated. ``folders``: family -> its tiny model
    (built under a temporary folder when not given: about a minute)."""
    if folders is None:
        with tempfile.TemporaryDirectory() as tmp:
            return generate(tiny_folders(Path(tmp), family_names()), root)
    cols = columns()
    found = rows(folders, cols, proofs(root), gpu_runs(root))
    return {root / name: rewrite((root / name).read_text(encoding="utf-8"), block(found, cols, docs), name)
            for name, docs in PAGES.items()}


def write(root: Path = ROOT) -> list[Path]:
    written = []
    for path, text in generate(root=root).items():
        path.write_text(text, encoding="utf-8")
        written.append(path)
    return written
