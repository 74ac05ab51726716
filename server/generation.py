"""From an HTTP request to ``GenerationRequest``s, and from engine events back to text.

Two halves of the seam with the engine, both free of mlx:
- ``build_*`` functions validate everything that depends on the served model (vocabulary,
  context length, chat template) and resolve the sampler as generation_config -> server preset /
  config -> request, so a bad request is a 400 *before* it reaches the queue.
- ``ChoiceStream`` turns one choice's ``GenerationEvent``s into text deltas: EOS ids end the
  text, the incremental detokenizer keeps multi-byte characters whole, the stop matcher cuts the
  text right before a stop string (and cancels the engine, which stops within one cycle), and it
  counts the tokens actually emitted so ``usage`` and logprobs describe exactly those.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.api import GenerationEvent, GenerationRequest, GenerationStats, TokenLogprob
from engine.detokenizer import IncrementalDetokenizer, StopMatcher
from sampling.params import SamplingOverrides, SamplingParamError, SamplingParams, resolve
from server.errors import APIError, bad_request
from server.schemas import ChatCompletionRequest, ChatMessage, CompletionRequest, SamplingFields
from server.settings import ServerSettings

_SAMPLER_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "seed",
)


# ------------------------------------------------------------------------------------------
# request -> GenerationRequest
# ------------------------------------------------------------------------------------------
def resolve_sampling(
    engine: Any, server_layer: SamplingOverrides, req: SamplingFields
) -> SamplingParams:
    """generation_config -> server layer -> request, validated against the vocabulary."""
    values: dict[str, Any] = {k: getattr(req, k) for k in _SAMPLER_FIELDS}
    if req.logit_bias:
        try:
            values["logit_bias"] = {int(k): float(v) for k, v in req.logit_bias.items()}
        except (TypeError, ValueError) as exc:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from exc
    request_layer = SamplingOverrides.from_mapping(values)
    params = resolve(engine.sampling_defaults, server_layer, request_layer)
    if params.top_k >= engine.vocab_size:
        # top_k >= vocab keeps every token: the same as "off", which is what the sampler expects.
        params = replace(params, top_k=0)
    try:
        return params.validate(engine.vocab_size)
    except SamplingParamError as exc:
        raise bad_request(str(exc), param=exc.param, code="invalid_value") from exc


def check_common(req: SamplingFields, settings: ServerSettings, n_prompts: int = 1) -> list[str]:
    """Limits that do not depend on the model; returns the stop strings."""
    if req.n * n_prompts > settings.max_n:
        raise bad_request(f"n must be at most {settings.max_n}", param="n")
    stops = req.stop_list()
    if len(stops) > settings.max_stop_sequences:
        raise bad_request(
            f"at most {settings.max_stop_sequences} stop sequences are allowed", param="stop"
        )
    return stops


def decide_max_tokens(
    requested: int | None,
    prompt_len: int,
    context_length: int,
    settings: ServerSettings,
    param: str = "max_tokens",
) -> int:
    """The token budget; prompt + max_tokens beyond the context is a 400 (never a silent cut)."""
    room = context_length - prompt_len
    if room <= 0:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens, but the prompt "
            f"has {prompt_len} tokens.",
            param="messages" if param == "max_completion_tokens" else "prompt",
            code="context_length_exceeded",
        )
    if requested is None:
        default = settings.default_max_tokens
        return room if default is None else min(default, room)
    if prompt_len + requested > context_length:
        raise APIError(
            400,
            f"This model's maximum context length is {context_length} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
            f"{requested} for the completion).",
            param=param,
            code="context_length_exceeded",
        )
    return requested


def make_requests(
    prompt_ids: list[int],
    sampling: SamplingParams,
    *,
    n: int,
    max_tokens: int,
    engine: Any,
    req: SamplingFields,
    top_logprobs: int | None,
) -> list[GenerationRequest]:
    """n requests for one prompt; choice i gets seed + i so choices differ but reproduce."""
    out: list[GenerationRequest] = []
    for i in range(n):
        params = sampling
        if sampling.seed is not None and i:
            params = replace(sampling, seed=sampling.seed + i)
            try:
                params.validate(engine.vocab_size)
            except SamplingParamError as exc:
                raise bad_request(str(exc), param=exc.param) from exc
        draft = req.draft_tokens if req.draft_tokens is not None else engine.default_draft_tokens
        out.append(
            GenerationRequest(
                prompt_ids=list(prompt_ids),
                sampling=params,
                max_tokens=max_tokens,
                stop_token_ids=frozenset(engine.eos_token_ids),
                ignore_eos=req.ignore_eos,
                draft_tokens=draft,
                top_logprobs=top_logprobs,
            )
        )
    return out


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for j, part in enumerate(content):
        if part.type != "text" or not hasattr(part, "text"):
            raise bad_request(
                f"content part type {part.type!r} is not supported by this text model",
                param=f"messages.{index}.content.{j}",
            )
        texts.append(part.text)
    return "\n".join(texts)


def _template_message(message: ChatMessage, index: int) -> dict[str, Any]:
    """An OpenAI message -> the dict the Qwen chat template expects."""
    role = "system" if message.role == "developer" else message.role
    out: dict[str, Any] = {"role": role, "content": _message_text(message, index)}
    if message.name:
        out["name"] = message.name
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.tool_calls:
        calls = []
        for j, call in enumerate(message.tool_calls):
            args: Any = call.function.arguments
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except ValueError as exc:
                    raise bad_request(
                        "tool call arguments must be a JSON object",
                        param=f"messages.{index}.tool_calls.{j}.function.arguments",
                    ) from exc
            calls.append(
                {
                    "id": call.id,
                    "type": "function",
                    "function": {"name": call.function.name, "arguments": args},
                }
            )
        out["tool_calls"] = calls
    return out


def select_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """The tools to show the model (None: tool calling off for this request)."""
    choice = req.tool_choice
    if not req.tools:
        if choice == "required" or (choice is not None and not isinstance(choice, str)):
            raise bad_request("tool_choice requires tools", param="tool_choice")
        return None
    tools = [t.model_dump(exclude_none=True) for t in req.tools]
    if choice == "none":
        return None
    if choice is not None and not isinstance(choice, str):
        tools = [t for t in tools if t["function"]["name"] == choice.function.name]
        if not tools:
            raise bad_request(
                f"tool_choice names an unknown function {choice.function.name!r}",
                param="tool_choice",
            )
    return tools


_RESERVED_TEMPLATE_KWARGS = {
    "conversation",
    "messages",
    "tools",
    "tokenize",
    "add_generation_prompt",
    "return_dict",
    "return_tensors",
    "chat_template",
    "documents",
}


def render_chat(tokenizer: Any, req: ChatCompletionRequest, tools: list[dict] | None) -> str:
    """Apply the checkpoint's chat template; template errors are the client's 400."""
    messages = [_template_message(m, i) for i, m in enumerate(req.messages)]
    kwargs = {
        k: v
        for k, v in (req.chat_template_kwargs or {}).items()
        if k not in _RESERVED_TEMPLATE_KWARGS
    }
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # jinja2 TemplateError, TypeError from odd kwargs, ...
        raise bad_request(f"could not apply the chat template: {exc}", param="messages") from exc
    if not isinstance(text, str):
        raise bad_request("the chat template did not produce text", param="messages")
    return text


def encode_prompts(tokenizer: Any, req: CompletionRequest, vocab_size: int) -> list[list[int]]:
    """``prompt`` (string, token ids, or a batch of either) -> token-id lists, each non-empty."""
    prompt = req.prompt
    batch: list[str | list[int]]
    if isinstance(prompt, str):
        batch = [prompt]
    elif prompt and all(isinstance(p, int) for p in prompt):
        batch = [list(prompt)]  # type: ignore[arg-type]
    else:
        batch = list(prompt)  # type: ignore[arg-type]
    if not batch:
        raise bad_request("prompt must not be empty", param="prompt")
    out: list[list[int]] = []
    for item in batch:
        ids = tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else item
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        bad = next((t for t in ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is out of range [0, {vocab_size})", param="prompt")
        out.append(list(ids))
    return out


# ------------------------------------------------------------------------------------------
# engine events -> text
# ------------------------------------------------------------------------------------------
@dataclass
class Step:
    """What one engine event contributed to a choice."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceStream:
    """One choice: engine events -> text deltas, with EOS, stop strings and token accounting."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        eos_ids: frozenset[int],
        stop: list[str],
        ignore_eos: bool,
        cancel: Callable[[], None],
        prompt_key: int = 0,
    ) -> None:
        #: which prompt this choice continues (usage counts cached tokens once per prompt)
        self.prompt_key = prompt_key
        self._eos = frozenset() if ignore_eos else frozenset(eos_ids)
        self._detok = IncrementalDetokenizer(tokenizer, skip_ids=self._eos)
        self._stop = StopMatcher(stop)
        self._cancel = cancel
        self.completion_tokens = 0
        self.stats: GenerationStats | None = None
        self.finish_reason: str | None = None
        self.first_token = False

    def step(self, event: GenerationEvent) -> Step:
        out = Step()
        if self.finish_reason is not None:
            return out
        if event.stats is not None:
            self.stats = event.stats
        finish: str | None = None
        for i, token in enumerate(event.token_ids):
            self.completion_tokens += 1
            self.first_token = True
            out.token_ids.append(token)
            if event.logprobs is not None and i < len(event.logprobs):
                out.logprobs.append(event.logprobs[i])
            if token in self._eos:
                finish = "stop"
                break
            emit, stopped = self._stop.feed(self._detok.add([token]))
            out.text += emit
            if stopped:
                finish = "stop"
                self._cancel()  # the engine stops at its next cycle
                break
        if finish is None and event.finish_reason is not None:
            finish = event.finish_reason
        if finish is not None:
            if not self._stop.stopped:
                emit, _ = self._stop.feed(self._detok.flush())
                out.text += emit + self._stop.flush()
            self.finish_reason = finish
            out.finish_reason = finish
        return out
