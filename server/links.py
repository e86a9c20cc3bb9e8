"""Absolute links for response_format=url, built without trusting the Host header blindly.

OpenAI returns absolute URLs and clients fetch them as they are (the openai SDK user's ``httpx.get(url)``, Open
WebUI, LibreChat), so a relative link is useless to them. The base is ``[server] public_base_url`` when set;
otherwise the request's own scheme and Host, but only when the Host's name is one this server answers to
(``[server] allowed_hosts``, by default the bound address and the localhost names). Any other Host is refused
(400), never reflected into a link a client would follow.
"""

from __future__ import annotations

import re

from fastapi import Request

from engines.errors import InvalidRequestError
from server.settings import ServerSettings

_HOST = re.compile(r"(?P<name>\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9][A-Za-z0-9.-]*)(?::(?P<port>[0-9]{1,5}))?")


def link_base(request: Request, server: ServerSettings) -> str:
    """``scheme://host[:port]`` for the links of this request; 400 (param response_format) for a Host this server
    does not answer to, naming the settings that fix it."""
    if server.public_base_url:
        return server.public_base_url.rstrip("/")
    host = request.headers.get("host", "")
    match = _HOST.fullmatch(host)
    if match is None or match["name"].lower() not in server.link_hosts():
        shown = host[:64].encode("ascii", "backslashreplace").decode()
        raise InvalidRequestError(
            f"response_format url: the request's Host {shown!r} is not one this server answers to "
            f"({sorted(server.link_hosts())}), so no link is built from it; set [server] public_base_url, or add "
            "the host name to [server] allowed_hosts, or ask for b64_json", param="response_format")
    return f"{request.url.scheme}://{host}"


def image_link(request: Request, image_id: str) -> str:
    """The absolute URL of a stored image (``image_id`` is its file name, ``<id>.<ext>``)."""
    path = request.app.url_path_for("image_file", image_id=image_id)
    return link_base(request, request.app.state.settings.server) + str(path)
