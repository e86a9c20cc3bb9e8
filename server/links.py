"""Absolute links for response_format=url, built without trusting the Host header blindly.

OpenAI returns absolute URLs and clients fetch them as they are (the openai SDK user's ``httpx.get(url)``, Open
WebUI, LibreChat), so a relative link is useless to them. The base is ``[server] public_base_url`` when set;
otherwise the request's own scheme and Host, but only when the Host's name is one this server answers to
(``[server] allowed_hosts``, by default the bound address and the localhost names). Any other Host is refused
(400), never reflected into a link a client would follow.

Each link's image is its tenant's (issue 52 point 4): a fetch that presents another tenant's credentials gets 404,
as for an unknown image, so a link's existence does not leak. A fetch without credentials is served: clients
fetch the links they are given without a key (the id is an unguessable 128-bit capability, answered only to its
maker, short-lived).
"""

from __future__ import annotations

import hmac
import re
import threading
from collections import OrderedDict

from fastapi import FastAPI, Request

from engines.errors import InvalidRequestError
from server.middleware import key_digest, presented_secret, tenant_label
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


class LinkOwners:
    """The tenant of each stored url image, the newest ``max_items`` kept (more than the image store keeps)."""

    def __init__(self, max_items: int = 4096) -> None:
        self.max_items = max_items
        self._owners: OrderedDict[str, str] = OrderedDict()
        self._lock = threading.Lock()

    def bind(self, image_id: str, owner: str) -> None:
        with self._lock:
            self._owners[image_id] = owner
            while len(self._owners) > self.max_items:
                self._owners.popitem(last=False)

    def owner(self, image_id: str) -> str | None:
        with self._lock:
            return self._owners.get(image_id)


def link_owners(app: FastAPI) -> LinkOwners:
    """The app's link owners, created on first use (one per app)."""
    owners = getattr(app.state, "link_owners", None)
    if owners is None:
        owners = app.state.link_owners = LinkOwners()
    return owners


def store_image(request: Request, data: bytes, extension: str, owner: str) -> str:
    """Store one image for a url link, as ``owner``'s; returns its file name (``<id>.<ext>``)."""
    image_id: str = request.app.state.image_store.put(data, extension)
    link_owners(request.app).bind(image_id, owner)
    return image_id


def fetching_tenant(request: Request) -> str | None:
    """The tenant whose valid credentials a link fetch presents; None when auth is off or it presents none valid.
    The auth middleware passes link fetches without a key, so the key is matched here as it matches keys
    (constant time against every digest), unless the middleware already named the tenant."""
    registry = request.app.state.tenants
    if not registry.enabled:
        return None
    if request.scope.get("state", {}).get("tenant"):
        return tenant_label(request.scope)
    secret = presented_secret(request.headers.get("authorization", ""))
    if secret is None:
        return None
    digest, found = key_digest(secret), None
    for stored in registry.current.digests:
        if hmac.compare_digest(digest, stored):
            found = stored
    return str(registry.label_for(found)) if found is not None else None


def may_fetch(request: Request, image_id: str) -> bool:
    """Whether this fetch may have the image: a fetch without credentials may (a capability link); one presenting
    a tenant's credentials only when that tenant made it."""
    tenant = fetching_tenant(request)
    return tenant is None or tenant == link_owners(request.app).owner(image_id)
