"""`sdserve deploy record`: the content record of a built image — its digest, its `pip freeze`, a digest of its file
list and the doctor snapshot of a boot inside it — so a rollback restores code, versions and capabilities together,
and `sdserve gate` can compare two images' records (``compare``)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

from engines.errors import ConfigError

KIND = "sdserve-image-record"
# Run inside the image: name==version of every distribution (pip freeze's format; the image ships no pip).
FREEZE = ("import importlib.metadata as m; print('\\n'.join(sorted({f\"{d.metadata['Name'].lower()}==\"" 
          "f\"{d.version}\" for d in m.distributions()})))")
# Run inside the image: sha256 over (path, size, mode) of every regular file and link outside the runtime's mounts.
FILE_LIST = """
import hashlib, os, stat
skip = ("/proc", "/sys", "/dev", "/run", "/tmp", "/models", "/etc/hostname", "/etc/hosts", "/etc/resolv.conf")
h, n, size = hashlib.sha256(), 0, 0
for root, dirs, files in os.walk("/"):
    dirs[:] = sorted(d for d in dirs if not os.path.join(root, d).startswith(skip))
    for f in sorted(files):
        p = os.path.join(root, f)
        if p.startswith(skip):
            continue
        st = os.lstat(p)
        h.update(f"{p}\\0{st.st_size}\\0{stat.S_IMODE(st.st_mode):o}\\n".encode())
        n, size = n + 1, size + (st.st_size if stat.S_ISREG(st.st_mode) else 0)
print(h.hexdigest(), n, size)
"""


def _run(cmd: list[str], timeout: float = 600) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise ConfigError(f"{' '.join(cmd[:4])} ... failed ({done.returncode}): {done.stderr.strip()[-800:]}")
    return done.stdout


def inspect(engine: str, image: str) -> dict[str, Any]:
    data = json.loads(_run([engine, "image", "inspect", image]))[0]
    labels = (data.get("Config") or {}).get("Labels") or data.get("Labels") or {}
    return {"id": data["Id"], "digest": data.get("Digest", ""), "size_bytes": data.get("Size", 0),
            "labels": labels}


def build(engine: str, image: str, model: Path, run_flags: list[str], profile: str = "dev") -> dict[str, Any]:
    """The record: inspect data, freeze, file-list digest, and `sdserve doctor --json` (``profile``, the model
    mounted read-only) from a boot inside the image under a read-only root with a tmpfs /tmp."""
    run = [engine, "run", "--rm", *run_flags, "--read-only", "--tmpfs", "/tmp", "--entrypoint", "python", image]
    freeze = _run([*run, "-c", FREEZE]).split()
    digest, files, total = _run([*run, "-c", FILE_LIST]).split()
    doctor_cmd = [engine, "run", "--rm", *run_flags, "--read-only", "--tmpfs", "/tmp",
                  "-v", f"{model.resolve()}:/models/model:ro", "--entrypoint", "sdserve", image,
                  "doctor", "--json", "--profile", profile, "--model", "/models/model"]
    doctor = subprocess.run(doctor_cmd, capture_output=True, text=True, timeout=600)
    try:
        snapshot = json.loads(doctor.stdout)
    except json.JSONDecodeError:
        raise ConfigError(f"doctor inside {image} printed no snapshot: {doctor.stderr.strip()[-800:]}") from None
    return {"kind": KIND, "format": 1, "image": image, **inspect(engine, image), "freeze": freeze,
            "files": {"sha256": digest, "count": int(files), "bytes": int(total)}, "doctor": snapshot}


def read(path: Path) -> dict[str, Any] | None:
    """The image record in ``path``; None when the file is something else (e.g. a bench result)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    return data if isinstance(data, dict) and data.get("kind") == KIND else None


def write(path: Path, record: dict[str, Any]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def _versions(freeze: list[str]) -> dict[str, str]:
    return dict(line.split("==", 1) for line in freeze if "==" in line)


def compare(base: dict[str, Any], cand: dict[str, Any]) -> list[tuple[str, str, str, str]]:
    """(check, baseline, candidate, verdict) rows. Versions and digests that differ are reported as changed; a
    candidate that proves less than the baseline (not accelerated, another provider, a worse doctor exit, the
    TensorRT libraries gone) is a REGRESSION."""
    rows = []
    for key in ("digest", "id"):
        rows.append((f"image {key}", base.get(key, "")[:19], cand.get(key, "")[:19],
                     "ok" if base.get(key) == cand.get(key) else "changed"))
    rows.append(("file list", base["files"]["sha256"][:12], cand["files"]["sha256"][:12],
                 "ok" if base["files"]["sha256"] == cand["files"]["sha256"] else "changed"))
    bv, cv = _versions(base["freeze"]), _versions(cand["freeze"])
    for name in sorted(set(bv) | set(cv)):
        if bv.get(name) != cv.get(name):
            rows.append((f"package {name}", bv.get(name, "absent"), cv.get(name, "absent"), "changed"))
    bvar, cvar = base["labels"].get("io.sdserve.variant", "?"), cand["labels"].get("io.sdserve.variant", "?")
    rows.append(("variant", bvar, cvar, "REGRESSION" if (bvar, cvar) == ("trt", "notrt") else
                 ("ok" if bvar == cvar else "changed")))
    bd, cd = base["doctor"], cand["doctor"]
    worse = bool(bd.get("accelerated")) and not cd.get("accelerated")
    rows.append(("accelerated", str(bd.get("accelerated")), str(cd.get("accelerated")), "REGRESSION" if worse else
                 "ok"))
    bcode, ccode = bd.get("exit_code", {}).get("code", 0), cd.get("exit_code", {}).get("code", 0)
    rows.append(("doctor exit code", str(bcode), str(ccode), "ok" if ccode == bcode or ccode == 0 else "REGRESSION"))
    for name in sorted(set(bd.get("sessions", {})) | set(cd.get("sessions", {}))):
        bp = bd.get("sessions", {}).get(name, {}).get("providers_used", [])
        cp = cd.get("sessions", {}).get(name, {}).get("providers_used", [])
        rows.append((f"session {name} providers", ",".join(bp) or "none", ",".join(cp) or "none",
                     "ok" if bp == cp else "REGRESSION"))
    return rows
