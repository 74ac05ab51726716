"""vLLM's extension endpoints that clients rely on beyond OpenAI's APIs: the tokenizer's
(``/tokenize``, ``/detokenize``, ``/tokenizer_info``), in OpenAI's error shape as vLLM answers."""

from __future__ import annotations

from server.adapters.adapter import Adapter
from server.adapters.vllm import tokenizer

ADAPTER = Adapter(
    name="vllm",
    routers=(tokenizer.router,),
    endpoints={
        "/tokenize": "tokenize",
        "/detokenize": "detokenize",
        "/tokenizer_info": "tokenizer_info",
    },
)
