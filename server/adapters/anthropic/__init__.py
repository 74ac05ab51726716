"""Anthropic's Messages API (``/v1/messages``, ``/v1/messages/count_tokens``)."""

from __future__ import annotations

from server.adapters.adapter import Adapter
from server.adapters.anthropic import messages
from server.adapters.anthropic.errors import error_body

ADAPTER = Adapter(
    name="anthropic",
    routers=(messages.router,),
    endpoints={"/v1/messages": "messages", "/v1/messages/count_tokens": "count_tokens"},
    prefixes=("/v1/messages",),
    error_body=error_body,
)
