"""The built image, run for real (marker `container`; `make test-container`, never by plain `make test`).

The image under test: SDSERVE_TEST_IMAGE (default sdserve:0.1.0-notrt, what `make image` tags here). The engine:
SDSERVE_CONTAINER_ENGINE (default podman); extra `run` flags: SDSERVE_CONTAINER_RUN_FLAGS (the Makefile passes the
ones this machine needs). A missing image fails the test with the command that builds it: never a skip."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

ENGINE = os.environ.get("SDSERVE_CONTAINER_ENGINE", "podman")
IMAGE = os.environ.get("SDSERVE_TEST_IMAGE", "sdserve:0.1.0-notrt")
RUN_FLAGS = os.environ.get("SDSERVE_CONTAINER_RUN_FLAGS", "").split()
BOOT_S = 180  # a generous bound on a loaded 2-core machine; the tiny model is ready in seconds when idle


def engine(*args: str, timeout: float = 300, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run([ENGINE, *args], capture_output=True, text=True, timeout=timeout)
    if check:
        assert done.returncode == 0, f"{ENGINE} {' '.join(args[:3])}: {done.stdout[-800:]} {done.stderr[-1500:]}"
    return done


def until(what: str, condition: Callable[[], bool], timeout: float = BOOT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never happened within {timeout:.0f}s: {what}"
        time.sleep(0.2)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str) -> httpx.Response | None:
    try:
        return httpx.get(url, timeout=5)
    except httpx.HTTPError:
        return None


class Container:
    """One `ENGINE run -d` of the image on the host network, on its own free port (SDSERVE_PORT)."""

    def __init__(self, *flags: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.name = f"sdserve-test-{uuid.uuid4().hex[:8]}"
        self.url = f"http://127.0.0.1:{self.port}"
        envs = [f"--env={k}={v}" for k, v in {"SDSERVE_PORT": str(self.port), **(env or {})}.items()]
        engine("run", "-d", "--name", self.name, "--network", "host", *RUN_FLAGS, *envs, *flags, IMAGE, *args)

    def logs(self) -> str:
        done = engine("logs", self.name, check=False)
        return done.stdout + done.stderr

    def state(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(engine("inspect", self.name).stdout)[0]
        return data

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.state()["State"]["Running"], f"container exited:\n{self.logs()}"
            answer = get(f"{self.url}/ready")
            return answer is not None and answer.status_code == 200
        until(f"{self.name} /ready 200", ready)

    def health(self) -> tuple[int, str]:
        """Run the image's HEALTHCHECK once: (exit code, the health status the engine now records)."""
        done = engine("healthcheck", "run", self.name, check=False)
        return done.returncode, self.state()["State"]["Health"]["Status"]

    def remove(self) -> None:
        engine("rm", "-f", "-t", "0", self.name, check=False)


@contextlib.contextmanager
def container(*flags: str, args: tuple[str, ...] = (), env: dict[str, str] | None = None) -> Iterator[Container]:
    box = Container(*flags, args=args, env=env)
    try:
        yield box
    finally:
        box.remove()


@pytest.fixture(scope="session")
def image() -> dict[str, Any]:
    done = engine("image", "inspect", IMAGE, check=False)
    assert done.returncode == 0, f"no image {IMAGE}: build it with `make base-image image` first"
    data: dict[str, Any] = json.loads(done.stdout)[0]
    return data


@pytest.fixture(scope="session")
def model_dir(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model, readable by the image's non-root user (mounted read-only at /models/model)."""
    dest = tmp_path_factory.mktemp("mounted") / "model"
    shutil.copytree(tiny_model, dest)
    for path in [dest, *dest.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    return dest


def run_python(code: str, *flags: str) -> str:
    """Run Python inside the image (read-only root, tmpfs /tmp) and return its stdout."""
    done = engine("run", "--rm", *RUN_FLAGS, "--read-only", "--tmpfs", "/tmp", *flags, "--entrypoint", "python",
                  IMAGE, "-c", code)
    return done.stdout
