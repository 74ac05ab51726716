"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)."""

from __future__ import annotations

from server.api.adapter import Adapter
from server.api.anthropic import messages
from server.api.anthropic.errors import error_body

ADAPTER = Adapter(
    name="anthropic",
    routers=(messages.router,),
    endpoints={"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"},
    prefixes=("/v1/messages",),
    error_body=error_body,
)
