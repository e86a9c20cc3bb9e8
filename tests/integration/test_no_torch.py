"""Serving a request never imports torch, diffusers or transformers (checked in a fresh interpreter)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = """
import json, sys, time
from pathlib import Path
from fastapi.testclient import TestClient
from engines.engine import OrtEngine
from server.app import create_app
from server.settings import load_settings

settings = load_settings("dev")
with TestClient(create_app(OrtEngine(Path(sys.argv[1]), settings.runtime), settings)) as client:
    while client.get("/ready").json()["state"] not in ("ready", "failed"):
        time.sleep(0.05)
    status = client.post("/v1/images/generations", json={"prompt": "a cat", "steps": 2}).status_code
print(json.dumps({"status": status, "loaded": sorted(m for m in ("torch", "diffusers", "transformers")
                                                     if m in sys.modules)}))
"""


def test_serving_imports_no_torch(tiny_model: Path) -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(tiny_model)], capture_output=True, text=True,
                          timeout=120, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == {"status": 200, "loaded": []}
