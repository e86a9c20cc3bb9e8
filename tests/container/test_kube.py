"""`podman kube play` (a real consumer of Kubernetes YAML) of the rendered dev overlay: the tiny model on the CPU,
its probes (the image's healthcheck: /ready) pass, a generation succeeds, and the securityContext holds."""

from __future__ import annotations

import json
import os
import subprocess
import tarfile
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.container.conftest import ENGINE, engine, free_port, get, until

pytestmark = pytest.mark.container
ROOT = Path(__file__).parents[2]
OVERLAY = ROOT / "deploy" / "k8s" / "dev" / "deployment.yaml"


def _volume_with_model(name: str, model_dir: Path, tmp: Path) -> None:
    """A named volume (what podman binds a PersistentVolumeClaim to) holding the model at model/."""
    tarball = tmp / "models.tar"
    with tarfile.open(tarball, "w") as tar:
        tar.add(model_dir, arcname="model")
    engine("volume", "create", name)
    engine("volume", "import", name, str(tarball))


def _manifest(port: int, claim: str) -> dict[str, Any]:
    """The committed overlay on the host network (hostNetwork; this machine has no container bridge, so no port
    mapping either) on a free port, with a claim of its own; nothing else changes."""
    dep: dict[str, Any] = yaml.safe_load(OVERLAY.read_text())
    pod = dep["spec"]["template"]["spec"]
    pod["hostNetwork"] = True
    c = pod["containers"][0]
    del c["ports"]
    c["args"][c["args"].index("--port") + 1] = str(port)
    c["env"].append({"name": "SDSERVE_PORT", "value": str(port)})  # the healthcheck probes this port
    pod["volumes"][0]["persistentVolumeClaim"]["claimName"] = claim
    return dep


@pytest.fixture
def played(model_dir: Path, tmp_path: Path) -> Iterator[tuple[str, str]]:
    port, claim = free_port(), f"sdserve-models-{uuid.uuid4().hex[:8]}"
    _volume_with_model(claim, model_dir, tmp_path)
    path = tmp_path / "deployment.yaml"
    path.write_text(yaml.safe_dump(_manifest(port, claim)))
    # podman's runtime and rlimits for kube play come from containers.conf (kube play has no --runtime flag).
    conf = tmp_path / "containers.conf"
    conf.write_text(os.environ.get("SDSERVE_CONTAINERS_CONF", "") or
                    '[containers]\ndefault_ulimits = ["nproc=1000:1000", "nofile=1024:1024"]\n'
                    '[engine]\nruntime = "runc"\n')
    env = {**os.environ, "CONTAINERS_CONF": str(conf)}

    def kube(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ENGINE, "kube", *args], capture_output=True, text=True, timeout=300, env=env)

    done = kube("play", str(path))
    try:
        assert done.returncode == 0, done.stdout + done.stderr
        yield f"http://127.0.0.1:{port}", done.stdout
    finally:
        kube("down", str(path))
        engine("volume", "rm", "-f", claim, check=False)


def _container(play_output: str) -> dict[str, Any]:
    """The served container of the played pod (kube play prints `Pod:` and `Container:` ids)."""
    ids = play_output.split("Container:", 1)[1].split()
    assert len(ids) == 1, play_output
    data: dict[str, Any] = json.loads(engine("inspect", ids[0]).stdout)[0]
    return data


def test_kube_play_of_the_dev_overlay_serves_with_its_security_context(played: tuple[str, str]) -> None:
    url, play_output = played

    def ready() -> bool:
        answer = get(f"{url}/ready")
        return answer is not None and answer.status_code == 200
    until("the played pod is ready", ready)
    answer = httpx.post(f"{url}/v1/images/generations", json={"prompt": "a kube cube", "size": "64x64", "steps": 2},
                        timeout=120)
    assert answer.status_code == 200 and answer.json()["data"][0]["b64_json"], answer.text
    box = _container(play_output)
    host = box["HostConfig"]
    assert box["Config"]["User"].split(":")[0] == "10001"
    assert host["ReadonlyRootfs"] is True
    assert not box.get("EffectiveCaps"), box.get("EffectiveCaps")
    assert any("no-new-privileges" in opt for opt in host.get("SecurityOpt") or []), host.get("SecurityOpt")
    mounts = {m["Destination"]: m for m in box["Mounts"]}
    assert mounts["/models"]["RW"] is False
    # The probe podman made of the overlay's exec probe is the image's readiness check; run it once.
    assert "/opt/sdserve/healthcheck.py" in " ".join(box["Config"]["Healthcheck"]["Test"])
    check = engine("healthcheck", "run", box["Id"], check=False)
    assert check.returncode == 0, check.stdout + check.stderr
    assert ready()  # still serving after the probe
