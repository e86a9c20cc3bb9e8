"""The examples the README and the docs mark runnable (`<!-- runnable: ... -->` on the line before the fence) run as
written against a real dev server on the tiny model: the shell ones with bash (curl, python3), the Python ones with
this interpreter (the openai SDK the `client` extra installs). Only the server address is replaced. Each must exit 0
and every PNG it writes must be a real image; an example whose request the server refuses fails here."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

ROOT = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable:"
DOCUMENTED = "http://127.0.0.1:8000"
FENCE = re.compile(r"^```(bash|python)\n(.*?)^```$", re.MULTILINE | re.DOTALL)


def examples() -> list[tuple[str, str, str]]:
    """(id, language, code) of every block marked runnable in README.md and docs/*.md."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for index, match in enumerate(FENCE.finditer(text)):
            before = text[:match.start()].rstrip("\n").rsplit("\n", 1)[-1]
            if before.startswith(MARKER):
                found.append((f"{path.relative_to(ROOT)}#{index}", match.group(1), match.group(2)))
    return found


EXAMPLES = examples()


def test_a_handful_of_examples_are_marked() -> None:
    """The README's and the quickstart's first request (curl and openai SDK) and the API and edits pages'
    examples, at least."""
    files = {e[0].split("#")[0] for e in EXAMPLES}
    assert {"README.md", "docs/quickstart.md", "docs/api.md", "docs/edits.md"} <= files and len(EXAMPLES) >= 8, \
        [e[0] for e in EXAMPLES]


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    """The files the edit examples read: a 64x64 photo and an RGBA mask transparent where to repaint."""
    Image.new("RGB", (64, 64), (30, 90, 160)).save(tmp_path / "photo.png")
    mask = Image.new("RGBA", (64, 64), (0, 0, 0, 255))
    mask.paste((0, 0, 0, 0), (16, 16, 48, 48))
    mask.save(tmp_path / "mask.png")
    return tmp_path


@pytest.mark.parametrize(("where", "language", "code"), EXAMPLES, ids=[e[0] for e in EXAMPLES])
def test_marked_example_runs_against_the_server(dev_server: str, workdir: Path, where: str, language: str,
                                                code: str) -> None:
    assert DOCUMENTED in code, f"{where} talks to no local server"
    before = {p.name for p in workdir.iterdir()}
    script = code.replace(DOCUMENTED, dev_server)
    command = ["bash", "-e", "-o", "pipefail", "-c", script] if language == "bash" else [sys.executable, "-c", script]
    done = subprocess.run(command, cwd=workdir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{where} failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
    written = [p for p in workdir.glob("*.png") if p.name not in before]
    assert written, f"{where} wrote no image"
    for png in written:
        with Image.open(png) as image:
            assert image.size == (64, 64), (png.name, image.size)
