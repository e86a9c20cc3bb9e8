"""Every HTTP header sdserve reads or writes, named once. The CORS policy exposes exactly RESPONSE (server/app.py):
a header a response carries but a browser cannot read is a header that does not exist for a web client."""

from __future__ import annotations

REQUEST_ID = "x-request-id"
"""Both ways: a caller's id is echoed, else one is made."""
TIMEOUT = "x-sdserve-timeout-s"
"""Request: the caller's deadline in seconds."""

MODEL = "x-sdserve-model"
PROVIDER = "x-sdserve-provider"
"""The execution provider of the session that ran the denoiser (the LoRA variant's when a LoRA applied)."""
SEEDS = "x-sdserve-seeds"
BATCH_SIZE = "x-sdserve-batch-size"
WARNINGS = "x-sdserve-warnings"
IGNORED_FIELDS = "x-sdserve-ignored-fields"
INTERRUPTED = "x-sdserve-interrupted"
INTERRUPT = "x-sdserve-interrupt"
RESIDENT = "x-sdserve-resident"
MODE = "x-sdserve-mode"
STRENGTH = "x-sdserve-strength"
LORAS = "x-sdserve-loras"
PROVENANCE = "x-sdserve-provenance"
WATERMARK = "x-sdserve-watermark"
SERVER_TIMING = "server-timing"
RETRY_AFTER = "retry-after"
SHOULD_RETRY = "x-should-retry"

RESPONSE = (REQUEST_ID, MODEL, PROVIDER, SEEDS, BATCH_SIZE, WARNINGS, IGNORED_FIELDS, INTERRUPTED, INTERRUPT,
            RESIDENT, MODE, STRENGTH, LORAS, PROVENANCE, WATERMARK, SERVER_TIMING, RETRY_AFTER, SHOULD_RETRY)
"""Every header a response may carry: what CORS exposes."""
REQUEST = (REQUEST_ID, TIMEOUT, "authorization", "content-type")
"""The headers a browser may send (CORS allow_headers)."""
