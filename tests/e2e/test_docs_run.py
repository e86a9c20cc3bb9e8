"""The docs' CLI commands that need no server and no GPU run here as written (bash, in one temp tree holding what
they read: `models/tiny` a copy of the tiny model, `models/sd15-cuda` another, the config file the memory page's
snippet reads, a signed `out.png` and its `ca.pem`), and what the doc says they print or exit with is checked. Each
command is found in its page by its exact text: a doc edit that changes it fails here until the run is updated.
Commands with a server run in tests/e2e/test_docs_examples.py; every other fenced `sdserve` command of the docs is
listed in PARSE_ONLY with why it cannot run here (tests/unit/test_docs_commands.py parses it)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

from tests.e2e.conftest import ServerProcess
from tests.unit.test_docs_commands import all_commands

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Run:
    page: str
    command: str
    """The command exactly as the page writes it (a console synopsis's ``[--optional]`` groups are left out)."""
    exit_code: int
    printed: tuple[str, ...] = ()
    """Lines (or parts of one) the doc shows and stdout must hold."""
    wrote: tuple[tuple[str, str], ...] = ()
    """(file, text) the doc says the command writes, the text in the file."""
    reads: Callable[[Any], bool] | None = None
    """What the doc says of the command's JSON output."""
    near: Callable[[str], str] | None = None
    """Figures the doc shows that float rounding may move on another CPU (AVX-512 or not, Intel or AMD): given
    stdout, what is off beyond their tolerance ("" when they agree)."""


def _page(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def _block_after(page: str, heading: str) -> str:
    """The body of the fenced block that holds ``heading`` or, if none does, of the first one after it."""
    text = _page(page)
    start = text.index(heading)
    fences = re.finditer(r"^```\w*\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)  # paired from the top
    found = next((f for f in fences if f.end() > start), None)
    assert found, f"{page}: no fenced block after {heading!r}"
    return found.group(1)


GATE_ROW = re.compile(r"(\d+x\d+ output:[\d.]+ \d+ steps)\s+(\d+)/(\d+) reused\s+([\d.]+) dB mean, ([\d.]+) worst, "
                      r"time x[\d.]+\s+(\w+)")
"""A row of `sdserve gate --cache`'s table: check, reused/evaluations, mean and worst PSNR, time ratio, verdict."""


def _gate_doc() -> tuple[str, str]:
    """caching.md's table under the gate synopsis: its header and its row."""
    header, row = _block_after("docs/caching.md", "On demand, against any configuration:").split("\n")[1:3]
    return header.rstrip(), row


def _gate_row() -> tuple[str, ...]:
    """What the gate must print exactly: the header and the row's check (its figures: ``_gate_near``)."""
    header, row = _gate_doc()
    found = GATE_ROW.search(row)
    assert found, f"docs/caching.md's gate row no longer reads as a gate row: {row!r}"
    return header, found.group(1)


def _gate_near(stdout: str) -> str:
    """The row's figures as the page shows them, within what another CPU's float rounding may move: the reuse
    count by 3 of 60 evaluations (a gate decision near its threshold may flip), the PSNRs by 1.5 dB; the same
    verdict. The wall-time ratio is a timing and not compared."""
    want, got = GATE_ROW.search(_gate_doc()[1]), GATE_ROW.search(stdout)
    if want is None or got is None:
        return f"no gate row in the output: {stdout[-500:]!r}"
    off = [name for name, k, tolerance in (("reused", 2, 3), ("mean dB", 4, 1.5), ("worst dB", 5, 1.5))
           if abs(float(got.group(k)) - float(want.group(k))) > tolerance]
    off += ["evaluations"] * (got.group(3) != want.group(3)) + ["verdict"] * (got.group(6) != want.group(6))
    return f"{off}: the page shows {want.group(0)!r}, the gate printed {got.group(0)!r}" if off else ""


RUNS = [
    Run("docs/memory.md", "sdserve doctor --model flux-dev --plan-size 1024x1024 --plan-images 1 "
        "--device-memory-gib 140", 20,  # the production profile on a machine without a GPU: GPU_UNAVAILABLE
        tuple(_block_after("docs/memory.md", "FLUX.1-dev at 1024x1024, one image per batch").strip().split("\n"))),
    Run("docs/caching.md", "sdserve gate --cache --profile dev --model models/tiny", 0, _gate_row(), near=_gate_near),
    Run("docs/deployment.md", "sdserve serve --profile cuda --model models/sd15-cuda        # exit 20 on a node "
        "without a usable GPU, saying why", 20),
    Run("docs/deployment.md", "sdserve deploy render --profile cuda --image sdserve:0.1.0-notrt --out deploy/k8s-cuda",
        0, wrote=(("deploy/k8s-cuda/rollout.yaml", "sdserve/matrix-tensorrt: absent by design (cuda profile)"),
                  ("deploy/k8s-cuda/rollout.yaml", "sdserve:0.1.0-notrt"))),
    Run("docs/provenance.md", "sdserve verify out.png --trust ca.pem          # add --json for one JSON object per "
        "image", 0, ("out.png: TRUSTED", "  signed by: ", "  generator: sdserve", "  action: c2pa.created",
                     "  org.sdserve.generation: {")),
]
INLINE_RUNS = [
    Run("docs/gpu-path.md", "sdserve doctor --json --profile dev", 0,  # "says `accelerated: false`, verdict `cpu-dev`"
        reads=lambda out: out["accelerated"] is False and out["verdict"]["status"] == "cpu-dev"),
    Run("docs/gpu-path.md", "sdserve engines build --profile production --dry-run", 0,  # each set's verdict
        reads=lambda out: bool(out["option_parser"]) and all(v["accepted"] for v in out["option_parser"].values())),
    Run("docs/gpu-path.md", "sdserve accept --help", 0, ("  --step-budget STEP=SECONDS", "Default step budgets (s):")),
]
"""Complete commands of the prose (inline code spans, no placeholder) that run here, in the same tree (the dev
profile's model is `models/tiny`)."""
PARSE_ONLY = {
    "sdserve engines optimize --target cuda --fp16 --model models/sd15 --out models/sd15-cuda":
        "a minute of graph fusion even on the tiny model (tests/integration covers optimize)",
    "sdserve accept --profile cuda --model models/sd15-cuda --out accept/": "needs an NVIDIA GPU node (exit 20 here)",
    "sdserve accept --out accept/ --model models/sd15 --baseline baselines.toml": "needs a GPU node and a real model",
    "sdserve accept --out accept/ --model models/sd15 --compare http://replica:8000 --changed before.env after.env":
        "needs a GPU node, a real model and a second replica",
    "sdserve engines export --from /path/to/stable-diffusion-v1-5 --out models/sd15": "needs a real SD checkpoint",
    "sdserve serve --model models/sd15": "production profile: needs a GPU and a real model",
    "sdserve generate a lighthouse at dusk -o out.png --model models/sd15 --size 512x512":
        "production profile: needs a GPU and a real model",
    "sdserve engines build --profile openvino --model models/tiny":
        "the openvino build of the tiny model runs in tests/plugin_ep.py (openvino_model); its block serves after it",
    "sdserve serve --profile openvino --model models/tiny": "a long-running server (tests/e2e boot the openvino one)",
    "sdserve engines tiny --family flux --out models/flux-tiny --bpe "
    ".cache/wheels/open_clip_torch-3.3.0-py3-none-any.whl":
        "~25 s: the same build (in process) is the tiny_family fixture's, whose folder the rest of its block serves",
}
"""Fenced `sdserve` commands of the docs that do not run here, and why (each parses in test_docs_commands.py)."""


def _signed_png(folder: Path) -> None:
    """``folder/out.png`` signed by a throwaway credential whose CA is ``folder/ca.pem``."""
    from server.provenance import load_credential, sign_bytes
    from server.settings import ProvenanceSettings
    from tests.provenance_ca import make_credential

    key, chain, _ = make_credential().write(folder)
    pixels = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    settings = ProvenanceSettings(mode="require", key_file=str(key), chain_file=str(chain))
    facts = {"model": {"id": "tiny"}, "seed": 42}
    (folder / "out.png").write_bytes(sign_bytes(load_credential(settings), buffer.getvalue(), "image/png", facts))


@pytest.fixture(scope="module")
def tree(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder every command runs in, with what the docs' commands read (the memory page's snippet run first, as
    the page says, to write the `flux-dev` config folder)."""
    root = tmp_path_factory.mktemp("docs-run")
    (root / ".venv").symlink_to(Path(sys.executable).parent.parent)  # the pages' `.venv/bin/sdserve`
    shutil.copytree(tiny_model, root / "models" / "tiny")
    shutil.copytree(tiny_model, root / "models" / "sd15-cuda")
    (root / "tests" / "data").mkdir(parents=True)
    shutil.copy(ROOT / "tests" / "data" / "model_configs.json", root / "tests" / "data")
    _signed_png(root)
    snippet = _block_after("docs/memory.md", "write one out with")
    done = _bash(snippet, root)
    assert done.returncode == 0 and (root / "flux-dev" / "transformer" / "config.json").is_file(), done.stderr
    return root


def _env() -> dict[str, str]:
    """This venv's `sdserve` and `python` first on PATH, this repository importable (the pages' snippets run "from
    the repository root"), no SDSERVE_ variable of the caller."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SDSERVE_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env["PYTHONPATH"] = str(ROOT)
    return env


def _bash(script: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-o", "pipefail", "-c", script], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=180)


class DocServer(ServerProcess):
    """A page's `sdserve serve` line run by bash in ``cwd``, its port swapped for 0 (a free one: the test reads the
    address it logs)."""

    def __init__(self, line: str, cwd: Path) -> None:
        self.cmd = ["bash", "-c", f"exec {re.sub(r'--port [0-9]+', '--port 0', line)}"]
        self.proc = subprocess.Popen(self.cmd, cwd=cwd, env=_env(), stderr=subprocess.PIPE,
                                     stdout=subprocess.DEVNULL, text=True)
        self.lines = []
        self.url = None
        self._found = threading.Event()
        self._thread = threading.Thread(target=self._pump, daemon=True)
        self._thread.start()


@pytest.mark.parametrize("run", RUNS + INLINE_RUNS, ids=[f"{r.page}:{r.command.split('#')[0].strip()}"
                                                          for r in RUNS + INLINE_RUNS])
def test_doc_command_runs_as_written(tree: Path, run: Run) -> None:
    assert run.command in _page(run.page), f"{run.page} no longer has `{run.command}`: update RUNS"
    done = _bash(run.command, tree)
    assert done.returncode == run.exit_code, (run.command, done.returncode, done.stdout[-2000:],
                                              done.stderr[-2000:])
    lines = done.stdout.split("\n")
    missing = [want for want in run.printed if not any(want in line.rstrip() for line in lines)]
    assert not missing, f"{run.page}: `{run.command}` no longer prints {missing}:\n{done.stdout[-3000:]}"
    if run.reads is not None:
        assert run.reads(json.loads(done.stdout)), f"{run.page}: `{run.command}` no longer reads as the page says"
    if run.near is not None:
        off = run.near(done.stdout)
        assert not off, f"{run.page}: `{run.command}` prints other figures than the page: {off}"
    for file, text in run.wrote:
        assert text in _page(run.page), f"{run.page} no longer says {text!r}: update RUNS"
        assert text in (tree / file).read_text(encoding="utf-8"), f"{file} lacks {text!r}"


def test_every_fenced_sdserve_command_runs_or_says_why_not() -> None:
    """A new `sdserve` command in a doc's fence is run here (RUNS, LORA_SERVE, FLUX_SERVE), by the server examples,
    or listed in
    PARSE_ONLY with its reason; an entry of either list the docs no longer hold fails too."""
    fenced = {" ".join(["sdserve", *c.words[1:]]) for c in all_commands()
              if c.words[0].rsplit("/", 1)[-1] == "sdserve"}
    ran = {re.sub(r"\s+#.*", "", command) for command in [*(r.command for r in RUNS), LORA_SERVE, FLUX_SERVE]}
    bare = {c: re.sub(r" \[[^]]*\]", "", c) for c in fenced}  # a synopsis runs without its [optional] groups
    unlisted = {c for c in fenced if bare[c] not in ran and c not in PARSE_ONLY}
    assert not unlisted, f"fenced sdserve commands neither run nor excused: {sorted(unlisted)}"
    stale = set(PARSE_ONLY) - fenced | ran - set(bare.values())
    assert not stale, f"entries no doc fence holds: {sorted(stale)}"


LORA_SERVE = ("sdserve serve --profile dev --model models/tiny --lora-dir loras --port 8001   # or [runtime.lora] dir, "
              "or SDSERVE_LORA_DIR")


@pytest.fixture(scope="module")
def lora_server(tree: Path) -> Iterator[str]:
    """lora.md's setup: the page's snippet writes `loras/tiny_random.safetensors` from `models/tiny`, then its
    serve line serves that library."""
    snippet = _block_after("docs/lora.md", "## A LoRA for the tiny model")
    done = subprocess.run([sys.executable, "-c", snippet], cwd=tree, env=_env(), capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and (tree / "loras" / "tiny_random.safetensors").is_file(), done.stderr[-2000:]
    assert LORA_SERVE in _page("docs/lora.md"), "lora.md's setup line changed: update LORA_SERVE"
    server = DocServer(LORA_SERVE, tree)
    try:
        yield server.wait_ready()
    finally:
        assert server.stop() == 0, server.log


def test_the_lora_page_runs_as_written(lora_server: str, tree: Path) -> None:
    """lora.md against the server it sets up: the library lists `tiny_random` with the alias and the weight counts
    the page gives, the curl prints the `x-sdserve-loras` header, the Python client prints it in the form the page
    comments and writes a PNG."""
    import httpx

    listed = {row["name"]: row for row in httpx.get(f"{lora_server}/sdapi/v1/loras", timeout=30).json()}
    assert listed["tiny_random"]["alias"] == "tinyRandom", listed
    page = _page("docs/lora.md")
    assert "lists `tiny_random` (alias `tinyRandom`" in page
    documented = "http://127.0.0.1:8001"
    curl = _block_after("docs/lora.md", "the OpenAI edit routes refuse it as an unknown field")
    done = _bash(curl.replace(documented, lora_server), tree)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert re.search(r"(?im)^x-sdserve-loras: tiny_random:[0-9a-f]{12}:0\.8:1\s*$", done.stdout), done.stdout
    client = _block_after("docs/lora.md", "client.images.with_raw_response.generate(")
    assert documented in client
    done = subprocess.run([sys.executable, "-c", client.replace(documented, lora_server)], cwd=tree, env=_env(),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert re.fullmatch(r"tiny_random:[0-9a-f]{12}:0\.8:0\.8\n", done.stdout), done.stdout
    with Image.open(tree / "lighthouse.png") as image:
        assert image.size == (64, 64)


FLUX_BUILD = (".venv/bin/sdserve engines tiny --family flux --out models/flux-tiny "
              "--bpe .cache/wheels/open_clip_torch-3.3.0-py3-none-any.whl")
FLUX_SERVE = "sdserve serve --profile dev --model models/flux-tiny --port 8001"


def test_the_first_flux_image_runs_as_written(tree: Path, tiny_family: Callable[[str], Path]) -> None:
    """families.md's first Flux image: after its build line (the tiny_family fixture's build, the same code in
    process), the rest of the block runs as written under bash, 8001 swapped for a free port: the server in the
    background, the page's own wait on /ready, the request; it writes flux.png at 64x64. The background server is
    ended by its process group."""
    build, rest = _block_after("docs/families.md", "A first Flux image on the CPU").split("\n", 1)
    assert build == FLUX_BUILD and f".venv/bin/{FLUX_SERVE} &" in rest, "families.md's Flux block changed"
    shutil.copytree(tiny_family("flux"), tree / "models" / "flux-tiny")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    log = tree / "flux-block.log"  # a file, not a pipe: the background server holds its output open
    with log.open("w") as sink:
        block = subprocess.Popen(["bash", "-e", "-o", "pipefail", "-c", rest.replace("8001", str(port))], cwd=tree,
                                 env=_env(), stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = block.wait(timeout=180)
        finally:
            with contextlib.suppress(ProcessLookupError):  # the server the block left running in the background
                os.killpg(block.pid, signal.SIGTERM)
    assert code == 0, log.read_text(encoding="utf-8")[-4000:]
    with Image.open(tree / "flux.png") as image:
        assert image.size == (64, 64)
