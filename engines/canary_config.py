"""The boot self-test's canary suite (configs/canaries.toml): the canaries' prompts and seeds, per family tables, the
instruction-edit canary and the ControlNet canary (engines/health/selftest.py, controlnet_canary.py run them).
engines/config.py re-exports these models and loads the file."""

from __future__ import annotations

from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from engines.types.request import Batch, ImageSpec


class Shape(Protocol):
    """What a canary batch needs of a served shape (engines/config.py ``Shape``, a frozen dataclass)."""

    @property
    def width(self) -> int: ...
    @property
    def height(self) -> int: ...
    @property
    def batch(self) -> int: ...


class Canary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1, max_length=64)
    prompt: str = Field(..., min_length=1)
    negative_prompt: str = ""
    seed: int = Field(..., ge=0, le=2**32 - 1)


class EditCanary(BaseModel):
    """An instruction-edit family's edit canary: its prompt and seed on a fixed input image (a built-in pattern,
    ``image`` pixels a side: engines/health/selftest.py ``canary_input``), run at boot where the model edits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    name: str = Field(..., min_length=1, max_length=64)
    prompt: str = Field(..., min_length=1)
    seed: int = Field(..., ge=0, le=2**32 - 1)
    image: int = Field(64, ge=16, le=2048)
    steps: int | None = Field(None, ge=1, le=100)
    """Its steps (None: the set's): an edit's step runs the reference tokens too, so the boot keeps it short."""


class ControlNetCanary(BaseModel):
    """The ControlNet canary ([controlnet] in configs/canaries.toml): its prompt and seed, run at boot with each loaded
    ControlNet at weights 1 and 0 on a fixed control image (engines/health/controlnet_canary.py)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt: str = Field(..., min_length=1)
    seed: int = Field(..., ge=0, le=2**32 - 1)
    steps: int | None = Field(None, ge=1, le=100)
    """Its steps (None: the set's): a plain run and two per ControlNet at boot, so the boot keeps it short."""


class FamilyCanaries(BaseModel):
    """A model family's canary set ([family.<name>] in configs/canaries.toml): what it sets replaces the suite's."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int | None = Field(None, ge=1, le=100)
    scheduler: str | None = None
    guidance_scale: float | None = Field(None, ge=0, le=30)
    canary: tuple[Canary, ...] = ()
    """Prompts of this family's canaries; empty: the suite's."""
    edit: EditCanary | None = None
    """[family.<name>.edit]: the instruction edit canary of an instruction-edit family."""


class CanarySuite(BaseModel):
    """configs/canaries.toml"""

    model_config = ConfigDict(frozen=True, extra="forbid")

    steps: int = Field(8, ge=1, le=100)
    scheduler: str = "euler"
    guidance_scale: float = Field(7.5, ge=0, le=30)
    canary: tuple[Canary, ...] = Field(..., min_length=1)
    family: dict[str, FamilyCanaries] = {}
    """Per model family (sd1, sd2, sdxl, turbo): the canary set the self-test and watchdog run for it."""
    edit: EditCanary | None = None
    """The family's edit canary, once ``for_family`` applied a table with one to a model that edits."""
    controlnet: ControlNetCanary | None = None
    """[controlnet]: the ControlNet canary's prompt, seed and steps (None: the first canary's at the set's steps)."""

    def for_family(self, name: str, edits: bool = True) -> CanarySuite:
        """The suite a model of family ``name`` runs: this one with the family's table applied (its edit canary
        only where ``edits``: the model serves instruction edits)."""
        table = self.family.get(name)
        if table is None:
            return self
        update: dict[str, object] = {k: v for k, v in (("steps", table.steps), ("scheduler", table.scheduler),
                                                        ("guidance_scale", table.guidance_scale)) if v is not None}
        return self.model_copy(update={**update, "canary": table.canary or self.canary, "family": {},
                                       "edit": table.edit if edits else None})

    def batch(self, shape: Shape) -> Batch:
        specs = []
        for i in range(shape.batch):
            c = self.canary[i % len(self.canary)]
            specs.append(ImageSpec(c.prompt, c.negative_prompt, c.seed + i // len(self.canary), self.guidance_scale))
        return Batch(tuple(specs), shape.width, shape.height, self.steps, self.scheduler)

    def names(self, shape: Shape) -> list[str]:
        return [self.canary[i % len(self.canary)].name for i in range(shape.batch)]
