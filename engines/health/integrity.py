"""Model files watched after boot. The sessions hold the weights in memory, but a model folder that changes under a
running server no longer is the one that was proven (a redeploy gone wrong, a disk fault, tampering): the watchdog
asks ``IntegrityWatcher.check`` on every check, which stats each file (size, mtime, inode) and hashes it in full only
when those change. A changed file degrades readiness naming it (relative to the model folder, never an absolute
path); restoring it recovers."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from engines.artifacts import EP_DIR, MANIFEST, TRT_DIR, expected, sha256_file
from engines.errors import NotReadyError

Stat = tuple[int, int, int]


def _stat(path: Path) -> Stat | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_size, st.st_mtime_ns, st.st_ino


@dataclass
class Watched:
    """One file: the sha256 it must have, and the last stat seen with what it meant (None = intact)."""

    rel: str
    path: Path
    digest: str
    stat: Stat | None
    problem: str | None = None


def _listed(base: Path, prefix: str) -> list[Watched]:
    """A manifest and the files it lists, as they are now (boot has just verified them)."""
    manifest = base / MANIFEST
    if not manifest.is_file():
        return []
    watched = [Watched(prefix + MANIFEST, manifest, sha256_file(manifest), _stat(manifest))]
    try:
        files = json.loads(manifest.read_text(encoding="utf-8")).get("files", {})
    except (ValueError, AttributeError):
        return watched  # boot verification reports a malformed manifest; here we only watch it
    for rel, entry in sorted(files.items()) if isinstance(files, dict) else ():
        try:
            digest = expected(entry)[0]
        except (KeyError, TypeError, ValueError):
            continue
        watched.append(Watched(prefix + rel, base / rel, digest, _stat(base / rel)))
    return watched


class IntegrityWatcher:
    """``manifest.json`` (and ``trt/manifest.json``, ``ep/<EP>/manifest.json`` when present) and every file they
    list, as at load."""

    def __init__(self, folder: Path) -> None:
        self.files = _listed(folder, "") + _listed(folder / TRT_DIR, f"{TRT_DIR}/")
        eps = sorted(p for p in (folder / EP_DIR).iterdir() if p.is_dir()) if (folder / EP_DIR).is_dir() else []
        for ep in eps:
            self.files += _listed(ep, f"{EP_DIR}/{ep.name}/")

    def problems(self) -> list[str]:
        """What differs from load time, one line per file; hashes only files whose stat changed."""
        found = []
        for item in self.files:
            now = _stat(item.path)
            if now != item.stat:
                item.stat = now
                item.problem = self._judge(item, now)
            if item.problem:
                found.append(item.problem)
        return found

    @staticmethod
    def _judge(item: Watched, now: Stat | None) -> str | None:
        if now is None:
            return f"model file {item.rel} is missing since boot"
        try:
            digest = sha256_file(item.path)
        except OSError as exc:
            return f"model file {item.rel} cannot be read ({exc.strerror})"
        if digest != item.digest:
            return (f"model file {item.rel} changed on disk since boot "
                    f"(sha256 {digest[:12]}, expected {item.digest[:12]})")
        return None  # touched or rewritten with the same bytes

    def check(self) -> None:
        """Raises NotReadyError naming every file that changed (retryable: restoring the file recovers)."""
        problems = self.problems()
        if problems:
            raise NotReadyError("; ".join(problems))
