"""``alwayson_scripts.controlnet`` on the A1111 routes without and with a ControlNet folder
(server/a1111_request.py refuse_unsupported): an enabled unit without ``--controlnet-dir`` is a 422 naming the script,
webuiapi's idle ``{"args": []}`` (sent to any server whose scripts list the extension) changes nothing and is
accepted, and any other script stays refused."""

from __future__ import annotations

from typing import Any

import pytest

from engines.errors import InvalidRequestError
from server.a1111_request import Txt2ImgRequest


def _request(scripts: dict[str, Any]) -> Txt2ImgRequest:
    return Txt2ImgRequest.model_validate({"prompt": "x", "alwayson_scripts": scripts})


def test_enabled_unit_without_a_folder_is_refused_naming_the_script() -> None:
    with pytest.raises(InvalidRequestError, match="--controlnet-dir") as caught:
        _request({"ControlNet": {"args": [{"module": "canny", "model": "edges"}]}}).refuse_unsupported()
    assert caught.value.param == "alwayson_scripts.ControlNet"


@pytest.mark.parametrize("args", [[], [{"enabled": False, "module": "canny"}]])
def test_idle_script_is_accepted_without_a_folder(args: list[dict[str, Any]]) -> None:
    request = _request({"ControlNet": {"args": args}})
    request.refuse_unsupported()
    assert request.controlnet_script() == {"args": args}


def test_with_a_folder_the_script_is_served_in_any_case() -> None:
    request = _request({"controlNET": {"args": [{"module": "canny"}]}})
    request.refuse_unsupported(controlnet=True)
    assert request.controlnet_script() == {"args": [{"module": "canny"}]}
    with pytest.raises(InvalidRequestError) as caught:
        _request({"ADetailer": {"args": []}}).refuse_unsupported(controlnet=True)
    assert caught.value.param == "alwayson_scripts.ADetailer"
