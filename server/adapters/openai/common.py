"""Pieces the OpenAI-style adapters share: the /v1 router, request fields -> neutral params,
usage and logprob shapes, and the /v1/models endpoints."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from fastapi import Request

from engine.api import TokenLogprob
from server.adapters.openai.schemas import SamplingFields
from server.core.http import v1_router
from server.core.jobs import Job, Usage
from server.core.requests import GenerationParams
from server.core.sampler_schema import sent_sampling
from server.core.sse import DONE, sse_json
from server.errors import APIError
from server.state import ServerState

router = v1_router()


def openai_params(req: SamplingFields, **kw: Any) -> GenerationParams:
    """The fields chat and text completions share, in neutral form."""
    return GenerationParams(
        max_tokens=req.max_tokens,
        sampling=sent_sampling(req),
        logit_bias=req.logit_bias,
        stop=req.stop_list(),
        n=req.n,
        ignore_eos=req.ignore_eos,
        draft_tokens=req.draft_tokens,
        **kw,
    )


def usage_body(usage: Usage) -> dict[str, Any]:
    """Chat / text completions ``usage`` (CompletionUsage) plus ``speculative``."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "completion_tokens_details": {"reasoning_tokens": usage.reasoning_tokens},
        "speculative": usage.speculative(),
    }


def completion_body(job: Job, object_type: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
    """A finished chat or text completion."""
    body = {"id": job.id, "object": object_type, "created": job.created, "model": job.model}
    return body | {"choices": choices, "usage": usage_body(job.usage())}


class OpenAIStream:
    """What chat and text completion streams share: unnamed ``data:`` chunks of
    ``object_type``, ``usage: null`` on each chunk and a final usage chunk when the client asked
    (``stream_options.include_usage``), ``[DONE]`` last; an error is a ``{"error"}`` chunk."""

    object_type = ""

    def __init__(self, job: Job, include_usage: bool) -> None:
        self.job, self.include_usage = job, include_usage

    def chunk(self, choices: list[dict[str, Any]], usage: dict | None = None) -> dict[str, Any]:
        job = self.job
        body = {
            "id": job.id,
            "object": self.object_type,
            "created": job.created,
            "model": job.model,
        }
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = usage
        return sse_json(body)

    def start(self) -> Iterable[dict[str, Any]]:
        return ()

    def choice_end(self, index: int) -> Iterable[dict[str, Any]]:
        return ()

    def end(self) -> Iterable[dict[str, Any]]:
        if self.include_usage:
            yield self.chunk([], usage=usage_body(self.job.usage()))
        yield DONE

    def error(self, error: APIError) -> Iterable[dict[str, Any]]:
        return [sse_json(error.body()), DONE]


def logprob_items(state: ServerState, items: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Chat's (and Responses') per-token logprobs with their top alternatives."""
    tt = state.token_text
    return [
        {
            "token": tt.text(lp.token_id),
            "logprob": lp.logprob,
            "bytes": tt.bytes(lp.token_id),
            "top_logprobs": [
                {"token": tt.text(t), "logprob": v, "bytes": tt.bytes(t)} for t, v in lp.top
            ],
        }
        for lp in items
    ]


def _model_card(state: ServerState, name: str) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "mtpserve",
        "root": state.names[0],
        "max_model_len": state.engine.context_length,
    }


@router.get("/models")
async def list_models(request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mtp
    state.require_engine()
    return {"object": "list", "data": [_model_card(state, n) for n in state.names]}


@router.get("/models/{model_id:path}")
async def get_model(model_id: str, request: Request) -> dict[str, Any]:
    state: ServerState = request.app.state.mtp
    state.require_engine()
    state.check_model(model_id)
    return _model_card(state, model_id)
