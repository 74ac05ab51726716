"""``POST /v1/completions``: OpenAI's legacy text completions mapped onto the core.

The prompt is a string, token ids, or a batch of either; choices are ``n`` per prompt, in
order. The text is not parsed (no reasoning or tool-call split): it is what the model wrote,
cut at EOS or a stop string. With ``echo`` and ``logprobs`` the prompt's tokens lead the
logprobs as OpenAI's completions give them (the first with no logprob, each other scored after
the tokens before it): what evaluation harnesses read to score a text (lm-evaluation-harness's
``local-completions`` sums ``token_logprobs`` over a continuation it sent as part of the prompt).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from engine.api import TokenLogprob
from server.adapters.openai.common import OpenAIStream, completion_body, openai_params
from server.adapters.openai.schemas import CompletionRequest
from server.core.http import json_body, read_body, respond, v1_router
from server.core.jobs import Job, new_id, start_job
from server.core.output import OutputDelta
from server.core.requests import build_requests, encode_prompts
from server.errors import bad_request
from server.state import ServerState

router = v1_router()


@dataclass
class TextLogprobs:
    """The legacy completions logprobs object."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, state: ServerState, items: list[TokenLogprob], offset: int) -> None:
        """Append ``items``, the first starting at character ``offset``."""
        tt = state.token_text
        for lp in items:
            text = tt.text(lp.token_id)
            self.tokens.append(text)
            self.token_logprobs.append(lp.logprob)
            self.top_logprobs.append({tt.text(t): v for t, v in lp.top})
            self.text_offset.append(offset)
            offset += len(text)

    def add_prompt(self, state: ServerState, first: int, scored: list[TokenLogprob]) -> None:
        """The prompt's tokens: ``first`` (nothing before it to score it by), then ``scored``."""
        text = state.token_text.text(first)
        self.tokens.append(text)
        self.token_logprobs.append(None)
        self.top_logprobs.append(None)
        self.text_offset.append(0)
        self.add(state, scored, len(text))

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }


@router.post("/completions", response_model=None, openapi_extra=json_body(CompletionRequest))
async def completions(request: Request) -> Response:
    state, req = await read_body(request, CompletionRequest)
    model = state.check_model(req.model)
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens 0 is for echo (the prompt alone)", param="max_tokens")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(
            "best_of is served only equal to n (each choice as drawn, none ranked)",
            param="best_of",
        )
    if req.suffix:  # a completion that ignored it would not fit before the client's suffix
        raise bad_request(
            "suffix (fill-in-the-middle) is not served: send the model's own FIM prompt instead",
            param="suffix",
        )
    params = openai_params(
        req,
        top_logprobs=req.logprobs,
        top_logprobs_param="logprobs",
        prompt_logprobs=req.logprobs if req.echo else None,
    )
    # the prompt count is limited before anything is tokenized, which runs off the event loop
    prompts = await asyncio.to_thread(encode_prompts, state, req.prompt, n=params.n)
    requests = build_requests(state, prompts, params)
    job = await start_job(
        state, prompts, params, requests, model=model, id=new_id("cmpl"), parse=False
    )
    tokenizer = state.engine.tokenizer
    echoes = [
        tokenizer.decode(p.ids, skip_special_tokens=False) if req.echo else ""
        for p in prompts
        for _ in range(req.n)
    ]
    logprobs = req.logprobs is not None
    # each choice's prompt ids, where its logprobs lead with the prompt's
    firsts = [p.ids[0] if req.echo and logprobs else None for p in prompts for _ in range(req.n)]
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    encoder = TextStream(job, echoes, firsts, logprobs, include_usage) if req.stream else None
    return await respond(
        request,
        job,
        stream_with=encoder,
        body=lambda d: text_body(job, d, echoes, firsts, logprobs),
    )


def text_body(
    job: Job,
    deltas: list[list[OutputDelta]],
    echoes: list[str],
    firsts: list[int | None],
    logprobs: bool,
) -> dict[str, Any]:
    choices: list[dict[str, Any]] = []
    for index, steps in enumerate(deltas):
        text, first = echoes[index], firsts[index]
        lps = TextLogprobs()
        for step in steps:
            if first is not None and step.prompt_logprobs is not None:
                lps.add_prompt(job.state, first, step.prompt_logprobs)
            lps.add(job.state, step.logprobs, len(text))
            text += step.text
        choices.append(
            {
                "index": index,
                "text": text,
                "logprobs": lps.body() if logprobs else None,
                "finish_reason": job.choices[index].finish_reason,
            }
        )
    return completion_body(job, "text_completion", choices)


class TextStream(OpenAIStream):
    """text_completion chunks: the echo (if asked), then the text deltas."""

    object_type = "text_completion"

    def __init__(
        self,
        job: Job,
        echoes: list[str],
        firsts: list[int | None],
        logprobs: bool,
        include_usage: bool,
    ) -> None:
        super().__init__(job, include_usage)
        self.echoes, self.firsts, self.logprobs = echoes, firsts, logprobs
        self.offset = 0
        self.echo_pending = False

    def _choice(self, index: int, text: str, lps: dict | None, finish: str | None) -> dict:
        return {"index": index, "text": text, "logprobs": lps, "finish_reason": finish}

    def choice_start(self, index: int) -> Iterable[dict[str, Any]]:
        echo = self.echoes[index]
        self.offset = len(echo)
        # a scored prompt's echo waits for its scores, which come with the first delta
        self.echo_pending = bool(echo) and self.firsts[index] is not None
        if echo and not self.echo_pending:
            yield self.chunk([self._choice(index, echo, None, None)])

    def delta(self, index: int, step: OutputDelta) -> Iterable[dict[str, Any]]:
        if self.echo_pending:  # this choice's first prompt id is known (``firsts``)
            self.echo_pending = False
            body = None
            if step.prompt_logprobs is not None:
                echoed = TextLogprobs()
                echoed.add_prompt(self.job.state, self.firsts[index], step.prompt_logprobs)
                body = echoed.body()
            yield self.chunk([self._choice(index, self.echoes[index], body, None)])
        lps = TextLogprobs()
        lps.add(self.job.state, step.logprobs, self.offset)
        self.offset += len(step.text)
        if not step.text and not step.logprobs and step.finish_reason is None:
            return
        body = lps.body() if self.logprobs else None
        yield self.chunk([self._choice(index, step.text, body, step.finish_reason)])
