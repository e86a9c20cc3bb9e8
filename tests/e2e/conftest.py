"""A real `sdserve serve` subprocess on a free port, polled on /ready."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.provenance_ca import SigningCredential, make_credential

LISTENING = re.compile(r"listening on (http://\S+)")


class ServerProcess:
    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.cmd = [sys.executable, "-m", "server.cli", "serve", "--port", "0", *args]
        self.proc = subprocess.Popen(self.cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     env={**os.environ, **(env or {})})
        self.lines: list[str] = []
        self.url: str | None = None
        self._found = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)
            match = LISTENING.search(line)
            if match:
                self.url = match.group(1)
                self._found.set()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 60) -> str:
        if not self._found.wait(timeout):
            raise AssertionError(f"server never listened:\n{self.log}")
        assert self.url is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            response = httpx.get(f"{self.url}/ready")
            if response.status_code == 200:
                return self.url
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"server never became ready:\n{self.log}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
        code = self.proc.wait(timeout=30)
        self._thread.join(timeout=10)
        if self.proc.stderr is not None:
            self.proc.stderr.close()
        return code


@pytest.fixture(scope="module")
def credential() -> SigningCredential:
    """A signing credential from a test CA made here (tests/provenance_ca.py)."""
    return make_credential()


@pytest.fixture(scope="module")
def dev_process(tiny_model: Path) -> Iterator[ServerProcess]:
    server = ServerProcess("--profile", "dev", "--model", str(tiny_model))
    try:
        server.wait_ready()
        yield server
    finally:
        assert server.stop() == 0, server.log


@pytest.fixture(scope="module")
def dev_server(dev_process: ServerProcess) -> str:
    assert dev_process.url is not None
    return dev_process.url


@pytest.fixture(scope="session")
def controlnet_tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(tiny SD 1.x model with unet_controlnet/, its tiny ControlNet folder) as `sdserve engines tiny --controlnet`
    builds them in a child process, once per session: each module serves its own copy (``controlnet_copy``)."""
    root = tmp_path_factory.mktemp("controlnet-tiny")
    model, net = root / "model", root / "edges"
    done = subprocess.run([sys.executable, "-m", "server.cli", "engines", "tiny", "--out", str(model),
                           "--controlnet", str(net)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return model, net


def controlnet_copy(built: tuple[Path, Path], root: Path) -> tuple[Path, Path]:
    """(model, ControlNet library) under ``root``: copies of ``controlnet_tiny``'s build, the ControlNet as the
    library's ``edges``, as `engines tiny --out root/model --controlnet root/controlnets/edges` writes them."""
    import shutil

    model, library = root / "model", root / "controlnets"
    shutil.copytree(built[0], model)
    shutil.copytree(built[1], library / "edges")
    return model, library


DEV_TOML = Path(__file__).parents[2] / "configs" / "dev.toml"


def dev_config(tmp_path: Path, *, replace: dict[str, str] | None = None, append: str = "") -> Path:
    """configs/dev.toml with some lines replaced (exact text) and tables appended: a profile for one test."""
    text = DEV_TOML.read_text()
    for old, new in (replace or {}).items():
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / "profile.toml"
    path.write_text(text + append)
    return path


FAST_WATCHDOG = {"interval_s = 5.0": "interval_s = 0.3", "idle_before_canary_s = 1.0": "idle_before_canary_s = 0.1"}


def model_with_vae_output(tiny_model: Path, dest: Path, value: float) -> Path:
    """A copy of the tiny model whose VAE decoder outputs ``value`` at every pixel (conv_out weight zeroed, bias set),
    with its manifest re-signed so the file check passes and only the output itself is wrong. NaN gives non-finite
    output; a large negative value gives an all-black image after the [-1, 1] -> [0, 255] mapping."""
    import json
    import shutil

    import numpy as np
    import onnx
    from onnx import numpy_helper

    from engines.artifacts import file_table

    shutil.copytree(tiny_model, dest)
    path = dest / "vae_decoder" / "model.onnx"
    vae = onnx.load(path)
    conv_out = [n for n in vae.graph.node if n.op_type == "Conv"][-1]
    for tensor in vae.graph.initializer:
        if tensor.name in conv_out.input[1:]:
            array = numpy_helper.to_array(tensor)
            filled = np.zeros_like(array) if tensor.name == conv_out.input[1] else np.full_like(array, value)
            tensor.CopyFrom(numpy_helper.from_array(filled.astype(array.dtype), tensor.name))
    onnx.save(vae, path)
    manifest = json.loads((dest / "manifest.json").read_text())
    manifest["files"] = {k: v for k, v in file_table(dest).items() if k != "selftest.json"}
    (dest / "manifest.json").write_text(json.dumps(manifest))
    return dest
