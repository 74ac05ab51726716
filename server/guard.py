"""What keeps a web page the user visits from driving a server on their machine.

A browser lets any page send requests to ``http://127.0.0.1:PORT``; it only hides the replies
from it. So, by default:

* **Host**: the request must name this server as a loopback host (``localhost``, ``127.0.0.1``,
  ``[::1]``), the address it is bound to, or a name in ``allowed_hosts``. A DNS-rebinding page
  (its own name resolving to 127.0.0.1, so that it may read the replies) sends its own name and
  is refused (403). A server bound to every address (``0.0.0.0``, ``::``) accepts any name: it is
  reachable from the network anyway and should have an API key (``startup_warning``).
* **Origin**: a request a browser sends from another page carries that page's origin; it must be
  this server's own (the chat page's) or in ``allowed_origins`` (403 otherwise). Clients that are
  not browsers send no Origin and are not affected.
* **Content type**: a POST to ``/v1`` must say ``application/json`` (415 otherwise): the
  ``text/plain`` and form posts a page can send without asking the browser first are refused.

Every refusal is in the API's own error shape (the path decides, as for every other error).
"""

from __future__ import annotations

import ipaddress
import logging
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from server.adapters import error_response
from server.errors import APIError
from server.settings import ServerSettings

logger = logging.getLogger(__name__)

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::"})


def host_name(value: str) -> str:
    """The name of a Host header or an origin's netloc: no port, no brackets, lower case."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    name, _, _ = value.partition(":") if value.count(":") == 1 else (value, "", "")
    return name.rstrip(".")


def is_loopback(host: str) -> bool:
    name = host_name(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def startup_warning(settings: ServerSettings) -> str | None:
    """What to tell the operator when the server can be reached beyond this machine without an
    API key (None: bound to loopback, or a key is set)."""
    if is_loopback(settings.host) or settings.api_key is not None:
        return None
    return (
        f"serving on {settings.host or '*'} without an API key: anyone who can reach this "
        "address can use the model. Set --api-key (or MTPSERVE_API_KEY), or bind to 127.0.0.1 "
        "behind a reverse proxy (docs/SERVER.md, Security)."
    )


class RequestGuard:
    """The Host, Origin and content-type checks above (pure ASGI, in front of the routes)."""

    def __init__(self, app: ASGIApp, settings: ServerSettings) -> None:
        self.app = app
        extra = {host_name(h) for h in settings.allowed_hosts}
        bound = host_name(settings.host)
        self.any_host = "*" in extra or bound in WILDCARD_ADDRESSES
        self.hosts = LOOPBACK_NAMES | extra | {bound}
        self.any_origin = "*" in settings.allowed_origins
        self.origins = {o.strip().rstrip("/").lower() for o in settings.allowed_origins}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        error = self.refusal(scope)
        if error is not None:
            await error_response(error, scope.get("path", ""))(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> APIError | None:
        headers = Headers(scope=scope)
        host = headers.get("host", "")
        if not self.any_host and host_name(host) not in self.hosts:
            logger.warning("refused a request for host %r", host)
            return APIError(
                403,
                f"the Host {host!r} is not served here; add it to allowed_hosts "
                "(--allowed-hosts) to serve it",
                code="host_not_allowed",
            )
        origin = headers.get("origin")
        if origin is not None and not self._origin_allowed(origin, host):
            logger.warning("refused a request from origin %r", origin)
            return APIError(
                403,
                f"requests from the web origin {origin!r} are not allowed; add it to "
                "allowed_origins (--allowed-origins) to allow it",
                code="origin_not_allowed",
            )
        path = scope.get("path", "")
        if scope.get("method") == "POST" and path.startswith("/v1/"):
            media = headers.get("content-type", "").split(";")[0].strip().lower()
            if media != "application/json" and not media.endswith("+json"):
                return APIError(
                    415,
                    "the request body must be JSON: send 'Content-Type: application/json'",
                    code="unsupported_media_type",
                )
        return None

    def _origin_allowed(self, origin: str, host: str) -> bool:
        origin = origin.strip().rstrip("/").lower()
        if self.any_origin or origin in self.origins:
            return True
        parts = urlsplit(origin)
        # same origin: the page this server served (the chat page) names the server's Host
        return parts.scheme in ("http", "https") and parts.netloc == host.strip().lower()
