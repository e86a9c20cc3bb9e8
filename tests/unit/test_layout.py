"""The house rules, read from the source's import graph (ast, nothing imported):

- no import cycle among sdserve's modules (function-level imports included);
- no module imports a private (underscore) name from another module;
- server/ reaches engines/ only through the protocol, the error types and the config types (plus the one engine
  constructor, engines.factory, and the build-time package for the `sdserve engines` commands);
- engines/ never imports FastAPI, Starlette or server/;
- torch, diffusers and transformers are imported only under engines/build/.
"""

from __future__ import annotations

import ast
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("server", "engines")
SERVER_MAY_IMPORT = ("engines.protocol", "engines.types", "engines.errors", "engines.config", "engines.factory",
                     "engines.families")
BUILD_ONLY = ("torch", "diffusers", "transformers")
CLI_BUILD = "server/cli/engines.py"
CLI_REFS = "server/cli/refs.py"
"""The reference generator (`make refs`): it walks every module of engines/ for the error hierarchy."""
"""The `sdserve engines` build commands drive engines/build/ (torch allowed there, imported lazily)."""


def _parse(path: Path) -> ast.Module:
    """ast.parse, once more in a fresh thread on CPython 3.11's spurious "AST constructor recursion depth mismatch"
    SystemError (seen in clean-clone CI runs: this thread's recursion counter is off after an earlier deep
    recursion; a new thread starts with its own): a parser bug, not a layout finding."""
    source = path.read_text(encoding="utf-8")
    try:
        return ast.parse(source)
    except SystemError:
        with ThreadPoolExecutor(max_workers=1) as pool:
            return pool.submit(ast.parse, source).result()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def _imports(path: Path) -> list[tuple[str, tuple[str, ...]]]:
    """(module, names) for every import statement in the file, at any depth."""
    found: list[tuple[str, tuple[str, ...]]] = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Import):
            found += [(alias.name, ()) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, tuple(alias.name for alias in node.names)))
    return found


def _ours(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


def _graph() -> dict[str, set[str]]:
    modules = {_module(p) for p in _files()}
    graph: dict[str, set[str]] = {}
    for path in _files():
        edges = graph.setdefault(_module(path), set())
        for module, names in _imports(path):
            if not _ours(module):
                continue
            # "from engines.health import selftest" depends on engines.health.selftest, not the package.
            targets = [f"{module}.{n}" for n in names if f"{module}.{n}" in modules] or [module]
            edges.update(t for t in targets if t in modules)
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return [*stack[stack.index(nxt):], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_the_walker_sees_imports_inside_functions_and_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None
    serve = _imports(ROOT / "server" / "cli" / "serve.py")
    assert ("server.app", ("create_app",)) in serve  # imported inside run(): the walker must see it


def test_no_import_cycle() -> None:
    cycle = _cycle(_graph())
    assert cycle is None, f"import cycle: {' -> '.join(cycle or [])}"


def test_no_private_names_imported_across_modules() -> None:
    offenders = [f"{path.relative_to(ROOT)}: from {module} import {name}" for path in _files()
                 for module, names in _imports(path) if _ours(module) for name in names
                 if name.startswith("_") and name != "__version__"]
    assert offenders == []


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(ROOT).parts[0] == "server"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_server_reaches_engines_only_through_the_protocol(path: Path) -> None:
    where = path.relative_to(ROOT).as_posix()
    allowed = SERVER_MAY_IMPORT + (("engines.build",) if where == CLI_BUILD else ()) + (
        ("engines",) if where == CLI_REFS else ())
    bad = [module for module, _ in _imports(path) if module.split(".")[0] == "engines"
           and not module.startswith(allowed)]
    assert bad == [], f"{path.relative_to(ROOT)} imports engine internals {bad}: go through engines.protocol"


def test_the_protocol_types_are_a_leaf() -> None:
    """engines/types/ (the data crossing the protocol) imports nothing of sdserve but itself, so server/ reaching it
    reaches no engine internals through it."""
    types = sorted((ROOT / "engines" / "types").rglob("*.py"))
    assert types, "engines/types/ holds the protocol's data types"
    bad = [f"{path.relative_to(ROOT)}: {module}" for path in types for module, _ in _imports(path)
           if _ours(module) and not module.startswith("engines.types")]
    assert bad == []


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(ROOT).parts[0] == "engines"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_engines_never_import_the_http_layer(path: Path) -> None:
    bad = [m for m, _ in _imports(path) if m.split(".")[0] in ("fastapi", "starlette", "uvicorn", "server")]
    assert bad == []


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(ROOT).parts[0] == "server"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_http_layer_reaches_onnx_runtime_only_through_engines(path: Path) -> None:
    """An ONNX session the server needs (an annotator, an upscaler) is built in engines/ and reached through
    engines.factory, so the provider policy and the session rules live in one place."""
    bad = [m for m, _ in _imports(path) if m.split(".")[0] == "onnxruntime"]
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}"


@pytest.mark.parametrize("path", _files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_torch_only_at_build_time(path: Path) -> None:
    if path.relative_to(ROOT).parts[:2] == ("engines", "build"):
        return
    bad = [m for m, _ in _imports(path) if m.split(".")[0] in BUILD_ONLY]
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}: torch/diffusers/transformers are build-time only"


def test_every_engines_module_lives_in_a_room() -> None:
    """engines/ top level holds the contract (protocol, errors, config and its canary suite, factory, the family and
    architecture registries), the engine (and its step verbs) and artifacts (and their checks); everything else is in
    a room: runtime/, pipelines/, numerics/, health/, lora/, accept/, build/, types/."""
    top = sorted(p.stem for p in (ROOT / "engines").glob("*.py"))
    assert top == ["__init__", "architectures", "artifact_checks", "artifacts", "canary_config", "config", "engine",
                   "errors", "factory", "families", "protocol", "steps"]


@pytest.mark.parametrize("path", [p for p in _files() if p.relative_to(ROOT).parts[0] == "server"],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_the_server_never_names_a_family(path: Path) -> None:
    """Family facts live in the registry (engines/families.py); the server reads them through the served model's
    family, so no string in server/ is a family's name (a new family then touches no server file)."""
    from engines.families import REGISTRY

    named = [node.value for node in ast.walk(_parse(path))
             if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in REGISTRY]
    assert named == [], f"{path.relative_to(ROOT)} names families {named}: read engines/families.py instead"


LAYERS: tuple[tuple[str, ...], ...] = (
    ("types", "errors"),
    ("config", "canary_config", "artifacts", "families", "architectures", "protocol"),
    ("numerics", "runtime"),
    ("lora",),
    ("pipelines",),
    ("health",),
    ("build",),
    ("artifact_checks", "steps", "engine"),
    ("accept",),
    ("factory",),
)
"""engines/' rooms (a folder or a top-level module) from the bottom up: a module imports only from its own layer or
below (the cycle test orders modules within a layer). The registries sit low and name the pipelines by string."""


def _room(module: str) -> str:
    return module.split(".")[1]


def test_engines_rooms_import_one_way() -> None:
    rank = {room: i for i, layer in enumerate(LAYERS) for room in layer}
    graph = _graph()
    rooms = {_room(m) for m in graph if m.startswith("engines.") and m.count(".")}
    assert rooms <= set(rank), f"rooms missing from LAYERS: {sorted(rooms - set(rank))}"
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() if a.startswith("engines.") and a.count(".")
                    for b in targets if b.startswith("engines.") and b.count(".")
                    and rank[_room(b)] > rank[_room(a)])
    assert upward == [], f"imports against the layer order: {upward}"


def test_the_layer_check_sees_an_upward_import() -> None:
    rank = {room: i for i, layer in enumerate(LAYERS) for room in layer}
    assert rank["pipelines"] > rank["numerics"] and rank["engine"] > rank["pipelines"]


FAMILY_NAME_COMPARISONS_MAX = 5
"""At most this many comparisons against a family or base name outside the registries (engines/families.py,
engines/architectures.py): behaviour that differs per architecture lives in its pipeline class or registry row."""


def _family_comparisons(path: Path, names: set[str]) -> list[str]:
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            consts = [e for o in operands for e in (o.elts if isinstance(o, ast.Tuple | ast.List | ast.Set) else [o])]
            if any(isinstance(c, ast.Constant) and c.value in names for c in consts):
                found.append(f"{_where(path)}:{node.lineno}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and \
                node.func.attr in ("startswith", "endswith") and \
                any(isinstance(a, ast.Constant) and a.value in names for a in node.args):
            found.append(f"{_where(path)}:{node.lineno}")
    return found


def _where(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def test_family_names_are_compared_only_in_the_registries() -> None:
    from engines.architectures import REGISTRY as ARCHITECTURES
    from engines.families import REGISTRY

    names = set(REGISTRY) | {b for f in REGISTRY.values() for b in f.bases} | set(ARCHITECTURES)
    registries = {ROOT / "engines" / "families.py", ROOT / "engines" / "architectures.py"}
    found = [hit for path in _files() if path not in registries for hit in _family_comparisons(path, names)]
    assert len(found) <= FAMILY_NAME_COMPARISONS_MAX, found


def test_the_comparison_count_sees_a_comparison(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('def f(base):\n    return base == "sdxl" or base.startswith("flux") or base in ("sd3",)\n')
    assert len(_family_comparisons(probe, {"sdxl", "flux", "sd3"})) == 3


PRODUCTION_LINES_MAX = 600
"""A room you can name: no production file (server/, engines/, benchmarks/) over this many lines."""


def test_no_production_file_is_over_the_line_limit() -> None:
    paths = [*_files(), *sorted((ROOT / "benchmarks").rglob("*.py"))]
    over = {str(p.relative_to(ROOT)): n for p in paths
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > PRODUCTION_LINES_MAX}
    assert over == {}, f"over {PRODUCTION_LINES_MAX} lines (split by concern): {over}"
    assert len(paths) > 100  # the walk found the packages
