"""A1111's lax numbers: a number sent as a string is coerced as pydantic's lax mode coerces it, and nothing else is.

AUTOMATIC1111/stable-diffusion-webui ``modules/api/models.py`` builds its txt2img/img2img request models with
``create_model`` from the ``StableDiffusionProcessing*`` dataclass annotations (``Optional[int]``,
``Optional[float]``, ...) in pydantic's default lax mode. Clients rely on it: openOutpaint sends its seed field's
``.value`` (``"-1"``), the Photoshop plugin ``seed.toString()``, Discord bots ``"7.0"``. sdserve's A1111 models stay
strict for everything else (a boolean is not a number, a number is not a string); only a string sent to a number
field goes through pydantic's own lax conversion (``" 7 "``, ``"7.0"`` and ``"1_000"`` are integers, ``"7.5"`` is
not; ``"1e3"`` is a float), and a string it cannot parse is the same 422 A1111 answers, naming the field
(``int_parsing`` / ``float_parsing``). An int field takes an integral float too (``15.0``; ``15.5`` is a 422 naming the
field), as pydantic's lax mode reads one.
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import TypeAdapter, ValidationError
from pydantic_core import PydanticCustomError

_LAX: dict[type, TypeAdapter[Any]] = {int: TypeAdapter(int), float: TypeAdapter(float)}
"""pydantic's lax validators of the two number types (TypeAdapter validates in lax mode unless told otherwise)."""


def number_type(annotation: object) -> type | None:
    """int or float for a field annotated ``int``, ``float`` or either ``| None``; None for any other field."""
    if annotation in _LAX:
        return annotation
    if get_origin(annotation) in (Union, types.UnionType):
        numbers = [a for a in get_args(annotation) if a is not type(None)]
        if len(numbers) == 1 and numbers[0] in _LAX:
            return numbers[0]  # type: ignore[no-any-return]
    return None


def lax_number(kind: type | None, value: Any) -> Any:
    """``value`` as pydantic's lax mode reads it for a ``kind`` field when it is a string, or an integral float sent
    to an int field (``15.0``: aiyabot's Hires steps, which A1111's pydantic reads as 15); anything else as is (the
    strict model then judges it). What lax mode cannot read raises its own error type and message (``15.5`` to an
    int field: ``int_from_float``, "got a number with a fractional part")."""
    integral = kind is int and isinstance(value, float)
    if kind is None or not (isinstance(value, str) or integral):
        return value
    try:
        return _LAX[kind].validate_python(value)
    except ValidationError as exc:
        error = exc.errors()[0]
        raise PydanticCustomError(error["type"], error["msg"]) from None


def lax_extra(value: object) -> object:
    """An undeclared A1111 field's numeric string as a number (int when it parses as one, else float); anything
    else as is. For the fields compared against neutral values (subseed_strength "0")."""
    if not isinstance(value, str):
        return value
    for kind in (int, float):
        try:
            return _LAX[kind].validate_python(value)
        except ValidationError:
            continue
    return value
