"""Write a benchmark's table between its markers in a Markdown page (`make bench`: docs/benchmarks.md)."""

from __future__ import annotations

from pathlib import Path


def write_section(readme: Path | None, name: str, text: str) -> bool:
    """Replace what lies between ``<!-- bench:NAME:start -->`` and ``<!-- bench:NAME:end -->``; False if absent."""
    if readme is None or not readme.is_file():
        return False
    start, end = f"<!-- bench:{name}:start -->", f"<!-- bench:{name}:end -->"
    content = readme.read_text()
    if start not in content or end not in content:
        return False
    head, rest = content.split(start, 1)
    readme.write_text(f"{head}{start}\n{text}\n{end}{rest.split(end, 1)[1]}")
    return True
