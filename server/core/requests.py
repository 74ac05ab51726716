"""What every API's request becomes before it reaches the queue: a prompt and its limits.

Adapters translate their own schema into the neutral pieces here — template messages (the dicts
the checkpoint's chat template reads), tools in the function-tool shape, and ``GenerationParams``
— and these functions do every model-dependent check (vocabulary, context length, chat template)
so that a bad request is a 400 in the caller's error shape *before* it is queued. Sampler fields
resolve as generation_config -> server preset / config -> request.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from engine.api import GenerationRequest
from sampling.constraint import (
    JSON_OBJECT_SCHEMA,
    GrammarError,
    json_schema_grammar,
    tool_call_grammar,
)
from sampling.params import (
    SAMPLER_FIELD_NAMES,
    SamplingOverrides,
    SamplingParamError,
    SamplingParams,
    resolve,
)
from server.core.chat_format import ChatFormat, Prompt, check_text_fits
from server.errors import APIError, bad_request
from server.state import ServerState


@dataclass
class GenerationParams:
    """An API's generation fields in neutral form (``*_param``: the field name for errors)."""

    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    prompt_param: str = "prompt"
    #: temperature, top_p, top_k, ... as sent (None: not sent)
    sampling: dict[str, Any] = field(default_factory=dict)
    logit_bias: dict[str, float] | None = None
    stop: list[str] = field(default_factory=list)
    stop_param: str = "stop"
    n: int = 1
    #: alternatives per emitted token; None = no logprobs
    top_logprobs: int | None = None
    top_logprobs_param: str = "top_logprobs"
    #: score the prompt too (completions' ``echo`` with ``logprobs``): alternatives per prompt
    #: token; None = the prompt is not scored
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    draft_tokens: int | Literal["auto"] | None = None
    #: structured output: the llguidance grammar of ``output_grammar`` (None: free text)
    grammar: str | None = None
    #: the most tokens the reply's reasoning may take (None: no budget); applies where the
    #: prompt leaves a think block open
    reasoning_budget: int | None = None


def join_text(
    content: str | Sequence[Any] | None, param: str, kinds: tuple[str, ...] = ("text",)
) -> str:
    """Message content (a string or parts with ``type`` and ``text``) -> text; a part of another
    type is a 400 naming it (this is a text model)."""
    if content is None or isinstance(content, str):
        return content or ""
    texts: list[str] = []
    for j, part in enumerate(content):
        text = getattr(part, "text", None)
        if part.type not in kinds or not isinstance(text, str):
            raise bad_request(
                f"content type {part.type!r} is not supported by this text model",
                param=f"{param}.{j}",
            )
        texts.append(text)
    return "\n".join(texts)


def parse_arguments(arguments: str | dict[str, Any], param: str) -> dict[str, Any]:
    """A tool call's arguments (JSON text or an object) -> the object the template renders.

    The arguments of a call this server cut at the token limit are an unclosed object (the
    parameters that were closed); agents send such a call back with its error result, so it
    reads as those parameters."""
    if isinstance(arguments, dict):
        return arguments
    value = _json_object(arguments) if arguments.strip() else {}
    if value is None and arguments.lstrip().startswith("{"):
        value = _json_object(arguments + "}")
    if not isinstance(value, dict):
        raise bad_request("tool call arguments must be a JSON object", param=param)
    return value


def _json_object(text: str) -> Any:
    try:
        return json.loads(text)
    except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
        return None


def select_tools(
    tools: list[dict[str, Any]] | None, choice: str | None, *, named: str | None = None
) -> list[dict[str, Any]] | None:
    """The tools to show the model. ``choice``: none / auto / required / None; ``named``: the
    one function a request forces (shown alone). None means tool calling is off."""
    if not tools:
        if choice == "required" or named is not None:
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return None
    if choice == "none":
        return None
    if named is not None:
        tools = [t for t in tools if t["function"]["name"] == named]
        if not tools:
            raise bad_request(
                f"tool_choice names an unknown function {named!r}", param="tool_choice"
            )
    return tools


def output_schema(kind: str | None, schema: Any, param: str) -> dict[str, Any] | None:
    """A structured-output setting -> the JSON schema the reply must follow (None: free text).

    ``kind``: ``text`` (or None), ``json_object`` (any JSON object) or ``json_schema`` (JSON
    valid under ``schema``, which ``output_grammar`` compiles once the prompt is rendered)."""
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return JSON_OBJECT_SCHEMA
    if not isinstance(schema, dict):
        raise bad_request("a json_schema format needs a 'schema' object", param=param)
    return schema


def refuse_structured_prefill(param: str, prefill_param: str | None) -> None:
    """A 400 when structured output (named by ``param``) comes with a prefill
    (``prefill_param``: the field holding the continued text, None for none): the schema
    covers the whole reply."""
    if prefill_param is not None:
        raise bad_request(
            f"a prefill (a continued final assistant message) cannot be combined with {param}: "
            "the schema covers the whole reply",
            param=prefill_param,
        )


#: reasoning effort -> whether the model thinks: the model has no finer setting than on / off
_THINKS_AT_EFFORT = {
    "none": False,
    "minimal": False,
    "low": True,
    "medium": True,
    "high": True,
    "xhigh": True,
}
ReasoningEffort = Literal["none", "minimal", "low", "medium", "high", "xhigh"]


def effort_kwargs(
    template_kwargs: dict[str, Any] | None, effort: ReasoningEffort | None
) -> dict[str, Any] | None:
    """The template arguments with OpenAI's reasoning effort applied: ``none`` and ``minimal``
    turn thinking off, any other effort on; ``enable_thinking`` set in the template arguments
    themselves wins (it is the more specific request)."""
    if effort is None:
        return template_kwargs
    return {"enable_thinking": _THINKS_AT_EFFORT[effort]} | dict(template_kwargs or {})


def prefill_kwargs(template_kwargs: dict[str, Any] | None, param: str) -> dict[str, Any]:
    """The template arguments of a reply that continues a final assistant message (a
    prefill): thinking off, since the reply would otherwise begin inside the reasoning;
    thinking asked for as well is a 400 naming ``param``."""
    kwargs = dict(template_kwargs or {})
    if kwargs.get("enable_thinking") is True:
        raise bad_request(
            "a prefill (a continued final assistant message) cannot be combined with "
            "thinking: the reply would begin inside the reasoning",
            param=param,
        )
    return kwargs | {"enable_thinking": False}


def output_grammar(
    state: ServerState,
    prompt: Prompt,
    schema: dict[str, Any] | None,
    schema_param: str = "response_format",
    force_tool_call: bool = False,
    parallel_tool_calls: bool = True,
) -> str | None:
    """The grammar of a rendered prompt's reply (None: free text): with ``force_tool_call``
    (``tool_choice`` required, or a named function) calls of the tools the prompt shows
    (exactly one unless ``parallel_tool_calls``); else ``schema``'s JSON, or where the prompt
    shows tools, either their calls or that JSON (an agent with an output type: tools until it
    answers in the schema); after the reasoning when the prompt leaves a think block open (the
    reasoning stays free text).

    A schema the grammar compiler cannot use is a 400 naming ``schema_param``: every token of
    the reply is drawn under the grammar, so nothing is left to a schema that was only half
    understood."""
    forced = force_tool_call and bool(prompt.tools)
    if schema is None and not forced:
        return None
    chat = ChatFormat.of(state.engine.tokenizer)
    end = chat.think_close if prompt.opens_reasoning else None
    call_ids = chat.tool_call_ids
    if schema is not None and not forced:
        json_only = not prompt.tools or call_ids is None  # no call the parser could read
        try:
            # the answer's JSON alone checks the schema; beside tools, tool_call_grammar
            # builds the reply's own grammar from the schema
            answer = json_schema_grammar(schema)
            if json_only and end is not None:
                grammar = json_schema_grammar(schema, reasoning_end=end)
            else:
                grammar = answer
        except GrammarError as exc:
            raise bad_request(str(exc), param=schema_param, code="invalid_json_schema") from exc
        compile_grammar = getattr(state.engine, "constraint", None)
        if end is not None and compile_grammar is not None:
            # after free reasoning the grammar's first token is always allowed: whether the
            # answer can begin at all is asked of the answer's grammar alone
            try:
                compile_grammar(answer)
            except ValueError as exc:  # engine.api.RequestError
                raise bad_request(
                    str(exc), param=schema_param, code=getattr(exc, "code", None)
                ) from exc
        if json_only:
            return grammar
    elif call_ids is None:
        raise bad_request(
            "this model's tokenizer has no tool-call tokens: tool_choice cannot force a call",
            param="tool_choice",
        )
    try:
        return tool_call_grammar(
            prompt.tools,
            call_ids,
            reasoning_end=end,
            parallel=parallel_tool_calls,
            answer_schema=None if forced else schema,
        )
    except GrammarError as exc:
        raise bad_request(str(exc), param="tools") from exc


def encode_prompts(
    state: ServerState, prompt: Any, param: str = "prompt", n: int = 1
) -> list[Prompt]:
    """A completion ``prompt`` (string, token ids, or a batch of either) -> prompts. The
    cheap limits come first: the prompt count (``n`` choices each) and each text's length,
    before anything is tokenized."""
    tokenizer, vocab_size = state.engine.tokenizer, state.engine.vocab_size
    batch: list[str | list[int]]
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [list(prompt)]
    else:
        batch = list(prompt)
    if not batch:
        raise bad_request("prompt must not be empty", param=param)
    limit = state.settings.max_n
    if len(batch) * n > limit:
        if len(batch) == 1:
            raise bad_request(f"n must be at most {limit}", param="n")
        raise bad_request(
            f"{len(batch)} prompts of {n} choice{'s' if n > 1 else ''} each: at most {limit} "
            "choices a request (send fewer prompts at once)",
            param=param,
        )
    for item in batch:
        if isinstance(item, str):
            check_text_fits(state, item, param)
    out: list[Prompt] = []
    for item in batch:
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else item
        if not ids:
            raise bad_request("prompt must not be empty", param=param)
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {vocab_size})", param=param)
        # raw ids get the turn facts too: a ChatML text sent here is cached like a chat's
        out.append(ChatFormat.of(tokenizer).prompt(list(ids)))
    return out


def check_limits(state: ServerState, params: GenerationParams, n_prompts: int = 1) -> None:
    """Limits that do not depend on the prompt."""
    settings = state.settings
    if params.n * n_prompts > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n}", param="n")
    if len(params.stop) > settings.max_stop_sequences:
        raise bad_request(
            f"at most {settings.max_stop_sequences} stop sequences are allowed",
            param=params.stop_param,
        )
    if (params.top_logprobs or 0) > settings.max_top_logprobs:
        raise bad_request(
            f"{params.top_logprobs_param} must be at most {settings.max_top_logprobs}",
            param=params.top_logprobs_param,
        )


def resolve_sampling(state: ServerState, params: GenerationParams) -> SamplingParams:
    """generation_config -> server layer -> request, built once into a sampler: the one place a
    request's sampler fields are checked (their bounds, and the vocabulary for top_k and
    logit_bias); a bad value is a 400 naming the field. The engine gets it as it is."""
    values = {k: v for k, v in params.sampling.items() if k in SAMPLER_FIELD_NAMES}
    if values.get("top_k") == -1:  # vLLM's convention for "off"; ours is 0
        values["top_k"] = 0
    if params.logit_bias:
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in params.logit_bias.items()}
        except (TypeError, ValueError) as exc:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from exc
    engine = state.engine
    try:
        return resolve(
            engine.sampling_defaults,
            state.sampling_layer,
            SamplingOverrides(**values),
            vocab_size=engine.vocab_size,
        )
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param, code="invalid_value") from exc


def decide_max_tokens(state: ServerState, params: GenerationParams, prompt_len: int) -> int:
    """The token budget; prompt + max_tokens beyond the context is a 400 (never a silent cut)."""
    context_length = state.engine.context_length
    room = context_length - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens, but the prompt "
            f"has {prompt_len} tokens.",
            param=params.prompt_param,
            code="context_length_exceeded",
        )
    requested = params.max_tokens
    if requested is None:
        default = state.settings.default_max_tokens
        return room if default is None else min(default, room)
    if prompt_len + requested > context_length:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion).",
            param=params.max_tokens_param,
            code="context_length_exceeded",
        )
    return requested


def build_requests(
    state: ServerState, prompts: list[Prompt], params: GenerationParams
) -> list[GenerationRequest]:
    """n requests per prompt; choice i of a prompt samples with seed + i (differ, reproduce)."""
    check_limits(state, params, n_prompts=len(prompts))
    engine = state.engine
    sampling = resolve_sampling(state, params)
    draft = params.draft_tokens if params.draft_tokens is not None else engine.default_draft_tokens
    think_close = ChatFormat.of(engine.tokenizer).think_close
    out: list[GenerationRequest] = []
    for prompt in prompts:
        max_tokens = decide_max_tokens(state, params, len(prompt.ids))
        budget = (
            params.reasoning_budget if prompt.opens_reasoning and think_close is not None else None
        )
        for i in range(params.n):
            choice_sampling = sampling
            if sampling.seed is not None and i:
                try:  # the sampler checks itself: seed + i may pass 2**63
                    choice_sampling = replace(sampling, seed=sampling.seed + i)
                except SamplingParamError as exc:
                    raise bad_request(str(exc), param=exc.param) from exc
            out.append(
                GenerationRequest(
                    prompt_ids=list(prompt.ids),
                    sampling=choice_sampling,
                    max_tokens=max_tokens,
                    stop_token_ids=frozenset(engine.eos_token_ids),
                    ignore_eos=params.ignore_eos,
                    draft_tokens=draft,
                    top_logprobs=params.top_logprobs,
                    prompt_logprobs=params.prompt_logprobs,
                    grammar=params.grammar,
                    snapshot_at=prompt.last_turn_start,
                    reasoning_budget=budget,
                    reasoning_end=think_close if budget is not None else None,
                )
            )
    return out
