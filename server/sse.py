"""Server-sent events as OpenAI frames them, and a streaming response that always cleans up.

OpenAI's stream is ``data: {json}\\n\\n`` per chunk and a final ``data: [DONE]\\n\\n`` (no event
names, no ids), which is what every OpenAI client parses, so the frames are written by hand.

``CancellingStreamingResponse`` runs ``on_close`` however the response ends — finished,
client gone (Starlette cancels the body iterator when it sees ``http.disconnect``), or an error —
so a disconnected client's generation is always cancelled instead of running on unobserved.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

logger = logging.getLogger(__name__)

DONE = b"data: [DONE]\n\n"

SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no", "Connection": "keep-alive"}


def sse_data(obj: Any) -> bytes:
    """One SSE event carrying a JSON object."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


class CancellingStreamingResponse(StreamingResponse):
    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers=SSE_HEADERS)
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
