"""Server-sent events for every API, through sse-starlette.

One response class for the four APIs: OpenAI's chat and completions streams are unnamed
``data:`` events ending in ``data: [DONE]``; Anthropic's and the Responses API's are named
events (``event: content_block_delta``). sse-starlette sends keep-alive pings while nothing else
is sent (a long prefill), as a comment line by default or as the API's own ping event
(Anthropic's ``event: ping``), and it notices a client that went away.

``EventStream`` runs ``on_close`` however the response ends — finished, client gone, or an
error — so a disconnected client's generation is always cancelled instead of running on
unobserved.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from sse_starlette import EventSourceResponse, ServerSentEvent
from starlette.types import Receive, Scope, Send

from server.core.finite import dumps_finite

logger = logging.getLogger(__name__)

DONE: dict[str, Any] = {"data": "[DONE]"}


def sse_json(obj: Any, event: str | None = None) -> dict[str, Any]:
    """One event carrying a JSON object (named when ``event`` is given)."""
    out: dict[str, Any] = {"data": dumps_finite(obj, ensure_ascii=False, separators=(",", ":"))}
    if event is not None:
        out["event"] = event
    return out


class EventStream(EventSourceResponse):
    def __init__(
        self,
        events: AsyncIterator[dict[str, Any]],
        *,
        on_close: Callable[[], None],
        ping_seconds: float,
        ping: Callable[[], ServerSentEvent] | None = None,
    ) -> None:
        super().__init__(
            events,
            ping=ping_seconds,
            sep="\n",
            ping_message_factory=ping,
            headers={"X-Accel-Buffering": "no"},
        )
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                self._on_close()
            except Exception:  # cleanup must not mask the real outcome
                logger.exception("stream cleanup failed")
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                try:
                    await aclose()
                except Exception:
                    logger.exception("closing the stream generator failed")
