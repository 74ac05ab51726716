"""OpenAI's APIs: chat completions, completions, responses and models."""

from __future__ import annotations

from server.adapters.adapter import Adapter
from server.adapters.openai import chat, common, completions, responses

ADAPTER = Adapter(
    name="openai",
    routers=(common.router, chat.router, completions.router, responses.router),
    endpoints={
        "/v1/chat/completions": "chat",
        "/v1/completions": "completions",
        "/v1/responses": "responses",
        "/v1/models": "models",
        "/v1/models/": "models",
    },
)
