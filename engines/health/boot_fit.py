"""The boot's memory check: a model whose memory plan (engines/health/memory_plan.py) does not fit the served
device is refused before a session is built, with the plan's numbers and what would fit (engines/health/
fit_advice.py), instead of an out-of-memory error halfway through the load (FLUX.2 [dev] in bf16 on an 80 GB card).

The plan is priced at the smallest request the server can take (one ``PROBE`` image): what does not fit then never
fits, and a larger batch is admission's to price per request. Only a device whose memory is known is checked (NVML,
on CUDA); a plan the files cannot give is logged and never stops the boot (the load itself says what is wrong)."""

from __future__ import annotations

import logging
from pathlib import Path

from engines.config import RuntimeSettings
from engines.errors import ModelLoadError
from engines.health.memory_plan import Budgets, for_runtime

log = logging.getLogger(__name__)
PROBE = (512, 512)
"""(width, height) of the one image the check prices: below every DiT's trained size, above the tiny models'."""


def require_fits(model: Path, runtime: RuntimeSettings, device_bytes: int | None, source: str) -> None:
    """ModelLoadError naming the need, the device's memory and what would fit, when one ``PROBE`` image does not fit
    ``device_bytes``; nothing when it fits or the device's memory is unknown."""
    if device_bytes is None:
        return
    try:
        plan = for_runtime(model, runtime, *PROBE, 1, 1, None, Budgets(device_bytes, source))
    except ModelLoadError as exc:
        log.warning("memory plan of %s not checked at boot: %s", model.name, exc)
        return
    verdict = plan["device"]["verdicts"]["base"]
    if verdict is None or verdict["fits"]:
        return
    gib = 1 << 30
    raise ModelLoadError(
        f"{model.name} does not fit {source}: its memory plan needs {verdict['need'] / gib:.2f} GiB for one "
        f"{PROBE[0]}x{PROBE[1]} image, the device has {verdict['have'] / gib:.2f} GiB ({plan['family']}; "
        f"`sdserve doctor --model {model}` prints the plan). What would fit: "
        + "; ".join(line.removeprefix("- ") for line in plan["advice"][1:]))
