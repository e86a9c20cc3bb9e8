"""The docs cannot drift from the code: the reference pages (settings keys, exit codes, metrics, API errors, CLI
flags) are regenerated in memory and compared with the checked-in ones; the site builds in strict mode; the pages
`make bench` and `make mutate` write into keep their markers; the README stays a front door."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import Field

from server.cli import refs
from server.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "docs" / "reference"
FIX = "run `make refs` (python -m server.cli.refs) and commit docs/reference/"


def entries(text: str) -> set[tuple[str, str]]:
    """What a reference page documents, read from its Markdown alone: (section, first cell) for every table row,
    (section, "") for every section. Settings keys, exit codes, metrics, error classes and flags are first cells."""
    found: set[tuple[str, str]] = set()
    section = ""
    for line in text.splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
            found.add((section, ""))
        elif line.startswith("| ") and not re.fullmatch(r"\|(---\|)+", line.replace(" ", "")):
            first = line.split(" | ")[0].removeprefix("| ").strip()
            found.add((section, first))
    header_cells = {"key", "code", "metric", "error", "flag or argument"}
    return {e for e in found if e[1] not in header_cells}


def drift(page: refs.Page, checked_in: str) -> str:
    """'' when the checked-in page documents exactly what the code has; else what is missing and what is extra."""
    code, docs = entries(page.text), entries(checked_in)
    lacks = sorted(f"{s}: {k}" if k else s for s, k in code - docs)
    extra = sorted(f"{s}: {k}" if k else s for s, k in docs - code)
    if not lacks and not extra:
        return ""
    return (f"docs/reference/{page.name} is out of date: it lacks {lacks or 'nothing'} and names "
            f"{extra or 'nothing'} that the code lacks; {FIX}")


@pytest.fixture(scope="module")
def pages() -> list[refs.Page]:
    return refs.generate()


def test_every_reference_page_is_checked_in_and_in_the_nav(pages: list[refs.Page]) -> None:
    nav = (ROOT / "mkdocs.yml").read_text(encoding="utf-8")
    for page in pages:
        assert (REFERENCE / page.name).is_file(), f"docs/reference/{page.name} is missing; {FIX}"
        assert f"reference/{page.name}" in nav, f"mkdocs.yml's nav lacks reference/{page.name}"


def test_reference_pages_document_what_the_code_has(pages: list[refs.Page]) -> None:
    problems = [drift(p, (REFERENCE / p.name).read_text(encoding="utf-8")) for p in pages
                if (REFERENCE / p.name).is_file()]
    assert not any(problems), "\n".join(p for p in problems if p)


def test_reference_pages_are_current(pages: list[refs.Page]) -> None:
    """Word for word: a changed default, docstring, bound, label or help text is drift too."""
    stale = [p.name for p in pages if not (REFERENCE / p.name).is_file()
             or (REFERENCE / p.name).read_text(encoding="utf-8") != p.text]
    assert not stale, f"docs/reference/{', '.join(stale)} differ from the code; {FIX}"


def test_the_pages_cover_every_code_metric_and_error(pages: list[refs.Page]) -> None:
    """Spot checks against the code's own objects, so a generator that dropped rows would not pass as current."""
    from server.exitcodes import ExitCode
    from server.metrics import Metrics

    by_name = {p.name: p.text for p in pages}
    for code in ExitCode:
        assert f"| {int(code)} | `{code.name}` |" in by_name["exit-codes.md"]
    for family in Metrics().registry.collect():
        if family.name.startswith("sdserve_"):
            assert f"`{family.name}" in by_name["metrics.md"]
    for error in refs.error_classes():
        assert f"| `{error.__name__}` |" in by_name["api-errors.md"]
    for key in ("`queue.max_size`", "`runtime.cuda.gpu_mem_limit_fraction`", "`watchdog.latency_unready`",
                "`family_defaults.<name>.steps`", "`canary[].seed`", "`budget_s`"):
        assert f"| {key} |" in by_name["settings.md"]
    assert "## `sdserve serve`" in by_name["cli.md"] and "| `--port` |" in by_name["cli.md"]


class _SettingsWithANewKey(Settings):
    """A profile model as a developer would change it: one more key, documented in its docstring."""

    brand_new_knob: int = Field(3, ge=1, le=9)
    """A key added to the code but not yet to the docs."""


def test_a_settings_key_added_without_regenerating_fails_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("server.settings.Settings", _SettingsWithANewKey)
    page = refs.settings_page()
    assert ("| `brand_new_knob` | int | `3` | A key added to the code but not yet to the docs. Bounds: ≥ 1, ≤ 9. |"
            in page.text)
    message = drift(page, (REFERENCE / "settings.md").read_text(encoding="utf-8"))
    assert "brand_new_knob" in message and "make refs" in message and "lacks" in message


def test_a_page_naming_what_the_code_lacks_fails_naming_it(pages: list[refs.Page]) -> None:
    metrics = next(p for p in pages if p.name == "metrics.md")
    stale = metrics.text + "| `sdserve_retired_total` | counter |  | gone |  |\n"
    message = drift(metrics, stale)
    assert "sdserve_retired_total" in message and "that the code lacks" in message


def test_generation_is_deterministic_and_ignores_the_environment(pages: list[refs.Page],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SDSERVE_MODEL", "elsewhere/model")
    monkeypatch.setenv("SDSERVE_LOG_LEVEL", "DEBUG")
    again = refs.generate()
    assert [p.text for p in again] == [p.text for p in pages]
    assert os.environ["SDSERVE_MODEL"] == "elsewhere/model"  # restored after the parser was built


def test_docs_build_strict_offline(tmp_path: Path) -> None:
    """mkdocs --strict: a broken link, an unknown anchor or a page left out of the nav fails the build."""
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "settings.html").is_file()
    built = (tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"<(script|link)[^>]+(src|href)=\"https?://", built), "the site must not fetch from the web"


@pytest.mark.parametrize(("page", "markers"), [
    ("docs/benchmarks.md", ("bench:pipeline", "bench:server", "bench:readiness")),
    ("docs/testing.md", ("mutation",)),
    ("docs/lora.md", ("bench:lora",)),
    ("docs/provenance.md", ("bench:watermark",)),
])
def test_generated_blocks_keep_their_markers(page: str, markers: tuple[str, ...]) -> None:
    """`make bench` and `make mutate` write between these markers (they skip a page without them, silently)."""
    text = (ROOT / page).read_text(encoding="utf-8")
    for marker in markers:
        start, end = f"<!-- {marker}:start -->", f"<!-- {marker}:end -->"
        assert text.count(start) == 1 and text.count(end) == 1 and text.index(start) < text.index(end)
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    assert f"--write-readme {page}" in makefile


def test_readme_is_a_front_door() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 200
    for must in ("make run", "make test", "curl -s http://127.0.0.1:8000/v1/images/generations", "openai.OpenAI(",
                 "## Support matrix", "## Where to get help"):
        assert must in readme
    for link, anchor in re.findall(r"\]\((docs/[^)#]+)(?:#([^)]+))?\)", readme):
        assert (ROOT / link).is_file(), f"README links to {link}, which does not exist"
        if anchor:  # the heading slug as code hosts and mkdocs make it: lower case, punctuation dropped, - for spaces
            slugs = {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
                     for h in re.findall(r"^#+ (.+)$", (ROOT / link).read_text(encoding="utf-8"), re.M)}
            assert anchor in slugs, f"README links to {link}#{anchor}: no such heading"


def test_support_matrix_is_the_same_on_the_readme_and_the_docs_home() -> None:
    def block(path: Path) -> str:
        text = path.read_text(encoding="utf-8")
        return text[text.index("<!-- support-matrix:start -->"):text.index("<!-- support-matrix:end -->")]

    assert block(ROOT / "README.md").replace("](docs/", "](") == block(ROOT / "docs" / "index.md")


def test_a_spurious_parser_systemerror_is_parsed_again_in_a_fresh_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPython 3.11's "AST constructor recursion depth mismatch" (a clean-clone CI run hit it inside
    inspect.getsource) is this thread's counter, not the source: the generator parses again in a new thread."""
    import ast
    import threading

    from server.cli import refs
    from server.settings import Settings

    parse = ast.parse
    calls: list[str] = []

    def flaky(*args: object, **kwargs: object) -> ast.Module:
        calls.append(threading.current_thread().name)
        if threading.current_thread() is threading.main_thread():
            raise SystemError("AST constructor recursion depth mismatch (before=165, after=216)")
        return parse(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(ast, "parse", flaky)
    docs = refs.attribute_docs(Settings)
    assert docs and len(calls) >= 2 and calls[0] == threading.main_thread().name != calls[-1]
