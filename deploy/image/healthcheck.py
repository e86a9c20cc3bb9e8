"""The image's HEALTHCHECK: healthy means ready. GET /ready on this container's configured port (SDSERVE_PORT):
200 -> exit 0; 503 while booting -> exit 1 (the runtime shows `starting` during the start period); 503 `failed`,
`degraded` or `draining`, or no answer, -> exit 1 (`unhealthy` once the start period is over). Prints the state and
reasons, which `docker inspect` / `podman inspect` keep with each probe. An argument names another path
(`/health`: the liveness probe of the dev Kubernetes overlay). Standard library only: it runs every
interval, so it must start fast and never import the server."""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request


def main(path: str) -> int:
    port = os.environ.get("SDSERVE_PORT", "8000")
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as resp:
            status, body = resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        status, body = exc.code, exc.read()
    except OSError as exc:
        print(f"no answer on port {port}: {exc}")
        return 1
    try:
        ready = json.loads(body)
    except ValueError:
        ready = {}
    print(f"{path} {status}: state {ready.get('state', '?')}; {'; '.join(map(str, ready.get('reasons', [])))}")
    return 0 if status == 200 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "/ready"))
