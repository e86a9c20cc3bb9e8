"""Mutation check: apply each mutation of tests/mutation/mutations.toml to a temporary COPY of the repository, run
its tests there, and report killed / survived. The working tree is never modified (others may be editing it).

    python tests/mutation/run.py [--only ID_PREFIX ...] [--markdown OUT.md] [--write-readme docs/testing.md]

A mutant is *killed* when its tests fail, *survived* when they pass, *stale* when its original snippet is not found
exactly once (the code moved on), *baseline-failing* when the same tests already fail on the unmutated copy (so a
failure would prove nothing). Exit status: 0 when every mutant was killed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MUTATIONS = Path(__file__).with_name("mutations.toml")
LINKED = (".cache", "models")
"""Not copied (large, read-only for tests): linked into the copy instead. The CLIP merges live in .cache."""


@dataclass(frozen=True)
class Mutation:
    id: str
    file: str
    original: str
    mutated: str
    tests: tuple[str, ...]


@dataclass(frozen=True)
class Outcome:
    mutation: Mutation
    status: str
    seconds: float
    detail: str = ""


def load(path: Path = MUTATIONS) -> list[Mutation]:
    data = tomllib.loads(path.read_text(encoding="utf-8"))
    return [Mutation(m["id"], m["file"], m["original"], m["mutated"], tuple(m["tests"])) for m in data["mutation"]]


def copy_repo(dest: Path) -> None:
    """Tracked and untracked-but-not-ignored files of the working tree as they are now (uncommitted edits
    included), plus links to the large read-only folders."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for rel in filter(None, listed):
        src = ROOT / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)
    for name in LINKED:
        if (ROOT / name).exists():
            (dest / name).symlink_to(ROOT / name)


def pytest(copy: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, str]:
    """Run ``tests`` in the copy (the copy's modules shadow the editable install: cwd comes first on sys.path)."""
    present = [t for t in tests if (copy / t.split("::")[0]).exists()]  # a file or a pytest node id
    if not present:
        return False, "none of the tests exist"
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *present]
    try:
        done = subprocess.run(cmd, cwd=copy, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False, f"timed out after {timeout:.0f}s"
    lines = (done.stdout + done.stderr).strip().splitlines()
    return done.returncode == 0, lines[-1] if lines else ""


def apply(copy: Path, m: Mutation) -> str | None:
    """Write the mutant into the copy; returns the original text to restore, or None when the snippet is stale."""
    path = copy / m.file
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    if text.count(m.original) != 1:
        return None
    path.write_text(text.replace(m.original, m.mutated), encoding="utf-8")
    return text


def run(mutations: list[Mutation], timeout: float) -> list[Outcome]:
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="sdserve-mutate-") as tmp:
        copy = Path(tmp)
        copy_repo(copy)
        baseline: dict[tuple[str, ...], tuple[bool, str]] = {}
        for m in mutations:
            start = time.monotonic()
            if m.tests not in baseline:
                baseline[m.tests] = pytest(copy, m.tests, timeout)
            ok, why = baseline[m.tests]
            if not ok:
                outcomes.append(Outcome(m, "baseline-failing", time.monotonic() - start, why))
                continue
            original = apply(copy, m)
            if original is None:
                outcomes.append(Outcome(m, "stale", 0.0, f"snippet not found exactly once in {m.file}"))
                continue
            try:
                passed, last = pytest(copy, m.tests, timeout)
            finally:
                (copy / m.file).write_text(original, encoding="utf-8")
            outcomes.append(Outcome(m, "survived" if passed else "killed", time.monotonic() - start, last))
            print(f"{outcomes[-1].status:>16}  {m.id}  ({last})", file=sys.stderr, flush=True)
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    lines = ["| mutant | file | tests | result |", "|---|---|---|---|"]
    for o in outcomes:
        tests = ", ".join(dict.fromkeys(Path(t.split("::")[0]).name for t in o.mutation.tests))
        mark = f"**{o.status}**" if o.status != "killed" else o.status
        lines.append(f"| `{o.mutation.id}` | `{o.mutation.file}` | {tests} | {mark} |")
    counts = {s: sum(o.status == s for o in outcomes) for s in ("killed", "survived", "stale", "baseline-failing")}
    lines.append("")
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items() if n) + f" of {len(outcomes)} mutants.")
    return "\n".join(lines)


def write_readme(readme: Path, report: str) -> bool:
    """Replace what lies between ``<!-- mutation:start -->`` and ``<!-- mutation:end -->``; False if absent."""
    start, end = "<!-- mutation:start -->", "<!-- mutation:end -->"
    text = readme.read_text(encoding="utf-8")
    if start not in text or end not in text:
        return False
    head, rest = text.split(start, 1)
    readme.write_text(f"{head}{start}\n{report}\n{end}{rest.split(end, 1)[1]}", encoding="utf-8")
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", default=None, help="run only mutants whose id starts with one of these")
    p.add_argument("--markdown", type=Path, default=None, help="also write the result table here")
    p.add_argument("--write-readme", type=Path, default=None,
                   help="put the table between the page's markers (make mutate: docs/testing.md)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per test run")
    args = p.parse_args(argv)
    mutations = [m for m in load() if not args.only or any(m.id.startswith(o) for o in args.only)]
    outcomes = run(mutations, args.timeout)
    report = table(outcomes)
    print(report)
    for o in outcomes:
        if o.status in ("stale", "baseline-failing"):
            print(f"- {o.mutation.id}: {o.status}: {o.detail}")
    if args.markdown is not None:
        args.markdown.write_text(report + "\n", encoding="utf-8")
    if args.write_readme is not None and not args.only:  # a partial run never replaces the recorded table
        write_readme(args.write_readme, report)
    return 0 if all(o.status == "killed" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
