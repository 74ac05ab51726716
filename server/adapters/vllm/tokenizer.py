"""``POST /tokenize``, ``POST /detokenize`` and ``GET /tokenizer_info`` as vLLM serves them.

Evaluation harnesses tokenize on the server when it answers these: lm-evaluation-harness's
``local-completions`` and ``local-chat-completions`` take their "remote" tokenizer when
``/tokenizer_info`` names an ``eos_token`` and ``/tokenize`` answers, and otherwise load the
model's tokenizer from the Hugging Face Hub by the served name (which a local folder, or a machine
without the Hub, does not have). The served model's own tokenizer answers: the ids are the ones
``/v1/completions`` takes as a prompt.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends, Request
from pydantic import BaseModel, ConfigDict

from server.auth import require_api_key
from server.core.chat_format import check_text_fits
from server.core.http import json_body, read_body
from server.errors import bad_request
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)])


class _Base(BaseModel):
    model_config = ConfigDict(extra="ignore")


class TokenizeRequest(_Base):
    """vLLM's completion form: a text (its chat form, ``messages``, is not served)."""

    model: str | None = None
    prompt: str
    #: the tokenizer's own special tokens around the text
    add_special_tokens: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Base):
    model: str | None = None
    tokens: list[int]


@router.post("/tokenize", response_model=None, openapi_extra=json_body(TokenizeRequest))
async def tokenize(request: Request) -> dict[str, Any]:
    state, req = await read_body(request, TokenizeRequest)
    if req.model is not None:
        state.check_model(req.model)
    check_text_fits(state, req.prompt, "prompt")
    encode = state.engine.tokenizer.encode
    ids = await asyncio.to_thread(encode, req.prompt, add_special_tokens=req.add_special_tokens)
    strs = [state.token_text.text(t) for t in ids] if req.return_token_strs else None
    return {
        "count": len(ids),
        "max_model_len": state.engine.context_length,
        "tokens": ids,
        "token_strs": strs,
    }


@router.post("/detokenize", response_model=None, openapi_extra=json_body(DetokenizeRequest))
async def detokenize(request: Request) -> dict[str, Any]:
    state, req = await read_body(request, DetokenizeRequest)
    if req.model is not None:
        state.check_model(req.model)
    vocab_size = state.engine.vocab_size
    bad = next((t for t in req.tokens if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise bad_request(f"token id {bad} is out of range [0, {vocab_size})", param="tokens")
    text = await asyncio.to_thread(state.engine.tokenizer.decode, req.tokens)
    return {"prompt": text}


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> dict[str, Any]:
    """What vLLM reports of the tokenizer: its class, special tokens and chat template."""
    state: ServerState = request.app.state.mtp
    state.require_engine()
    tok = state.engine.tokenizer
    return {
        "tokenizer_class": type(tok).__name__,
        "eos_token": tok.eos_token,
        "bos_token": tok.bos_token,
        "pad_token": tok.pad_token,
        "unk_token": tok.unk_token,
        "chat_template": getattr(tok, "chat_template", None),
        "model_max_length": state.engine.context_length,
        "vocab_size": state.engine.vocab_size,
    }
