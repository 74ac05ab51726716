"""Structured output is exact under speculation: a grammar-constrained request emits what plain
constrained decoding emits.

Greedy: the same tokens for K = 0, 1, 3 and automatic K (dense and MoE test checkpoints and the
demo model), and every output is a sentence of the grammar. Sampled: the chi-square homogeneity
test of tests/engine/test_sampling.py between K=3 (rejection sampling under masks) and K=0.
Drafts the grammar forbids (the head drafting over a small vocabulary) are rejected without
changing the output; constrained rows of a batch equal the same requests alone.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_batching import batched
from test_sampling import ALPHA, _homogeneity_pvalue

from engine.api import GenerationRequest, RequestError
from engine.cycle import speculative
from engine.runtime import Engine
from engine.scheduling.batching import BatchDecoder
from sampling.constraint import (
    GrammarError,
    TokenConstraint,
    closed_objects,
    json_schema_grammar,
    tool_call_grammar,
)
from sampling.params import SamplingParams

DEMO = Path(__file__).resolve().parents[2] / "models" / "qwen3.5-demo"
YES_NO_TOOL = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
}
#: bounded in every field, so that even a random model reaches the end and stops
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"enum": ["yes", "no", "maybe"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 99},
        "note": {"type": "string", "maxLength": 8},
    },
    "required": ["answer", "score", "note"],
    "additionalProperties": False,
}
GRAMMAR = json_schema_grammar(SCHEMA)
GREEDY = SamplingParams(temperature=0.0)


def request(engine: Engine, prompt: str, k: int | None, **kwargs: object) -> GenerationRequest:
    fields = {"sampling": GREEDY, "max_tokens": 80, "grammar": GRAMMAR} | kwargs
    return GenerationRequest(
        prompt_ids=engine.tokenizer.encode(prompt),
        stop_token_ids=engine.eos_token_ids,
        draft_tokens=k,
        **fields,
    )


def run(engine: Engine, req: GenerationRequest) -> tuple[list[int], str, object]:
    tokens: list[int] = []
    for event in engine.generate(req):
        tokens += event.token_ids
    return tokens, event.finish_reason, event.stats


def assert_follows(engine: Engine, tokens: list[int], grammar: str = GRAMMAR) -> None:
    """Every token was allowed where it stands (a fresh matcher takes them all)."""
    constraint = engine.constraint(grammar)
    for token in tokens:
        assert constraint.allowed()[token], engine.tokenizer.decode(tokens)
        constraint.consume(token)


@pytest.fixture(scope="module", params=["dense-tied", "moe-tied", "demo"])
def engine(request, load_engine) -> Engine:
    if request.param == "demo":
        return Engine.load(str(DEMO))
    return load_engine(request.param)


@pytest.fixture(scope="module")
def demo() -> Engine:
    """The demo model with the conversation cache on: the sampled test runs one prompt 600
    times, prefilled once (restores are exact: tests/engine/test_prefix_cache.py)."""
    engine = Engine.load(str(DEMO), draft_tokens=0)
    engine.enable_prefix_cache(64 << 20)
    return engine


def test_greedy_constrained_output_is_the_same_for_every_k(engine: Engine) -> None:
    for prompt in ("Reply in JSON: is water wet?", "def add(a, b):"):
        outputs = {k: run(engine, request(engine, prompt, k)) for k in (0, 1, 3, None)}
        plain, finish, _ = outputs[0]
        for k, (tokens, reason, _) in outputs.items():
            assert tokens == plain, f"K={k}"
            assert reason == finish
        assert finish == "stop" and plain[-1] in engine.eos_token_ids
        assert_follows(engine, plain)
        value = json.loads(engine.tokenizer.decode(plain[:-1]))
        assert value["answer"] in ("yes", "no", "maybe") and 0 <= value["score"] <= 99
        assert outputs[3][2].accepted > 0  # drafts were verified under the masks and kept


def test_a_thinking_reply_reasons_freely_then_answers_in_json(demo: Engine) -> None:
    """With the prompt's think block open, the grammar lets the reasoning run (no stop inside
    it) and starts the schema after ``</think>``: the same tokens for every K, and the text
    after the reasoning is the JSON."""
    from engine.runtime import chat_prompt_ids

    end = demo.tokenizer.get_vocab()["</think>"]
    grammar = json_schema_grammar(SCHEMA, reasoning_end=end)
    messages = [{"role": "user", "content": "Is water wet? Reply in JSON."}]
    prompt = chat_prompt_ids(demo.tokenizer, messages, enable_thinking=True)
    assert demo.tokenizer.decode(prompt).endswith("<think>\n")
    outputs = {}
    for k in (0, 1, 3, None):
        req = replace(request(demo, "", k, grammar=grammar, max_tokens=200), prompt_ids=prompt)
        outputs[k] = run(demo, req)[0]
    assert all(tokens == outputs[0] for tokens in outputs.values())
    tokens = outputs[0]
    assert end in tokens and tokens[-1] in demo.eos_token_ids
    assert_follows(demo, tokens, grammar)
    answer = demo.tokenizer.decode(tokens[tokens.index(end) + 1 : -1])
    assert answer.startswith("\n\n") and json.loads(answer)["answer"] in ("yes", "no", "maybe")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOW = {"type": "function", "function": {"name": "now", "parameters": {"properties": {}}}}


def forced_call_for_every_k(
    engine: Engine, grammar: str, prompt: list[int], max_tokens: int
) -> tuple[list[int], str]:
    """A constrained reply to ``prompt`` at K = 0, 1, 3 and auto: the same tokens and finish
    for every K, each token allowed where it stands; returns them."""
    outputs = {}
    for k in (0, 1, 3, None):
        req = request(engine, "", k, grammar=grammar, max_tokens=max_tokens)
        outputs[k] = run(engine, replace(req, prompt_ids=prompt))
    assert all(out[:2] == outputs[0][:2] for out in outputs.values())
    tokens, finish, _ = outputs[0]
    assert_follows(engine, tokens, grammar)
    return tokens, finish


def test_a_forced_tool_call_is_the_same_for_every_k(engine: Engine) -> None:
    """``tool_choice`` required: the reply is Qwen XML tool calls of the tools shown, nothing
    else, with the same tokens for every K (a value runs until its closing tag or max_tokens);
    with one call only and a tool without arguments, the call is the whole reply."""
    from engine.runtime import chat_prompt_ids

    vocab = engine.tokenizer.get_vocab()
    ids = (vocab["<tool_call>"], vocab["</tool_call>"])
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    for tools, parallel in (([WEATHER, NOW], True), ([NOW], False)):
        grammar = tool_call_grammar(tools, ids, parallel=parallel)
        prompt = chat_prompt_ids(engine.tokenizer, messages, tools=tools, enable_thinking=False)
        tokens, finish = forced_call_for_every_k(engine, grammar, prompt, max_tokens=60)
        assert tokens[0] == ids[0]
        if not parallel:
            text = engine.tokenizer.decode(tokens[:-1])
            assert (
                finish == "stop"
                and text == "<tool_call>\n<function=now>\n</function>\n</tool_call>"
            )


def test_tools_beside_an_output_schema_allow_their_calls_or_the_json_answer(demo: Engine) -> None:
    """Structured output with tools the model may call (an agent with an output type): the
    grammar takes a tool call of the tools shown or JSON valid under the schema, and nothing
    else from the first token; a reply under it is the same tokens for every K."""
    from engine.runtime import chat_prompt_ids

    vocab = demo.tokenizer.get_vocab()
    ids = (vocab["<tool_call>"], vocab["</tool_call>"])
    grammar = tool_call_grammar([WEATHER, NOW], ids, answer_schema=SCHEMA)

    def takes(text: str) -> bool:
        constraint = demo.constraint(grammar)
        for token in demo.tokenizer.encode(text) + [min(demo.eos_token_ids)]:
            if not constraint.allowed()[token]:
                return False
            constraint.consume(token)
        return True

    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
    assert takes(call + "</function>\n</tool_call>")
    assert takes('{"answer": "yes", "score": 7, "note": "wet"}')
    assert not takes('{"answer": "perhaps", "score": 7, "note": "wet"}')  # not in the enum
    assert not takes("Paris is sunny.")
    assert not takes("<tool_call>\n<function=get_time>\n</function>\n</tool_call>")
    messages = [{"role": "user", "content": "Is it raining in Paris? Reply in JSON."}]
    tools = [WEATHER, NOW]
    prompt = chat_prompt_ids(demo.tokenizer, messages, tools=tools, enable_thinking=False)
    tokens, finish = forced_call_for_every_k(demo, grammar, prompt, max_tokens=80)
    text = demo.tokenizer.decode(tokens[:-1] if finish == "stop" else tokens)
    assert text.startswith(("<tool_call>", "{")), text


ALARM_ARGUMENTS = {
    "type": "object",
    "properties": {
        "hour": {"type": "integer", "minimum": 0, "maximum": 23},
        "loud": {"type": "boolean"},
        "days": {"type": "array", "items": {"$ref": "#/$defs/day"}, "maxItems": 2},
        "tone": {"type": "string", "enum": ["bell", "chime"]},
        "snooze": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
    },
    "required": ["hour", "loud", "tone"],
    "additionalProperties": False,
    "$defs": {"day": {"enum": ["mon", "tue"]}},
}
ALARM = {"type": "function", "function": {"name": "set_alarm", "parameters": ALARM_ARGUMENTS}}


def test_a_forced_calls_arguments_are_valid_under_its_schema(engine: Engine) -> None:
    """A forced call's values follow their parameters' schemas: JSON of the declared type for
    integers, booleans, arrays (through ``$defs``) and a nullable integer, one of the ``enum``
    strings for a string; every required parameter present. The same tokens for every K, and
    the arguments the server's parser reads back are valid under the function's schema."""
    import jsonschema_rs

    from engine.runtime import chat_prompt_ids
    from server.core.toolcalls import ChatOutputParser

    vocab = engine.tokenizer.get_vocab()
    grammar = tool_call_grammar(
        [ALARM], (vocab["<tool_call>"], vocab["</tool_call>"]), parallel=False
    )
    messages = [{"role": "user", "content": "Wake me at seven."}]
    prompt = chat_prompt_ids(engine.tokenizer, messages, tools=[ALARM], enable_thinking=False)
    tokens, finish = forced_call_for_every_k(engine, grammar, prompt, max_tokens=300)
    assert finish == "stop", engine.tokenizer.decode(tokens)
    parser = ChatOutputParser(tools=[ALARM])
    parsed = parser.feed(engine.tokenizer.decode(tokens[:-1]))
    parsed.extend(parser.finish())
    (call,) = [delta for delta in parsed.tool_calls if delta.arguments is not None]
    arguments = json.loads(call.arguments)
    jsonschema_rs.validate(ALARM_ARGUMENTS, arguments)
    assert isinstance(arguments["hour"], int) and isinstance(arguments["loud"], bool)


@pytest.mark.fast
def test_a_property_schema_llguidance_cannot_enforce_is_free_text() -> None:
    """``uniqueItems`` is beyond llguidance: that value alone falls back to free text (as
    without a forced call); the request is not refused and the other values stay typed."""
    tool = {
        "type": "function",
        "function": {
            "name": "tag",
            "parameters": {
                "properties": {
                    "labels": {"type": "array", "uniqueItems": True},
                    "count": {"type": "integer"},
                }
            },
        },
    }
    grammar = tool_call_grammar([tool], (1, 2))
    assert '"<parameter=labels>\\n" TEXT_VALUE' in grammar
    assert "%json" in grammar and '"type": "integer"' in grammar


def test_sampled_constrained_output_is_distributed_as_plain_sampling(demo: Engine) -> None:
    """300 seeded requests with K=3 (rejection sampling, masked draft and target) against 300
    with K=0, the first four tokens position by position."""
    grammar = json_schema_grammar(
        {"type": "array", "items": {"type": "integer"}, "minItems": 2, "maxItems": 6}
    )
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.9)
    samples, counts = {}, [0, 0]
    for k in (0, 3):
        rows = []
        for seed in range(300):
            req = request(demo, "numbers = ", k, grammar=grammar, max_tokens=4, ignore_eos=True)
            tokens, _, stats = run(demo, replace(req, sampling=replace(params, seed=seed)))
            assert_follows(demo, tokens, grammar)
            rows.append(tokens)
            counts[0] += stats.accepted
            counts[1] += stats.proposed
        samples[k] = np.array(rows)
    assert 0.1 < counts[0] / counts[1] < 0.9  # acceptances and residual draws both ran
    for position in range(4):
        p = _homogeneity_pvalue(samples[0][:, position], samples[3][:, position])
        assert p > ALPHA, f"position {position + 1}: p={p:.2g}"


def test_drafts_the_grammar_forbids_are_rejected_without_changing_the_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A head drafting over 40 tokens often has no allowed token at all: it drafts unmasked,
    the draft is rejected and the cycle's later positions are never used."""
    engine = Engine.load(str(DEMO), draft_tokens=0, draft_vocab=40)
    refused = []
    follow = speculative._RowDrafts.follow

    def counted(row: speculative._RowDrafts) -> None:
        follow(row)
        refused.append(not row.following)

    monkeypatch.setattr(speculative._RowDrafts, "follow", counted)
    plain = run(engine, request(engine, "Reply in JSON:", 0))
    drafted = run(engine, request(engine, "Reply in JSON:", 3))
    assert drafted[0] == plain[0] and drafted[1] == plain[1] == "stop"
    assert any(refused) and drafted[2].accepted > 0


@pytest.mark.parametrize("one_pass", [False, True], ids=["passes-as-picked", "one-pass"])
def test_constrained_rows_of_a_batch_equal_each_request_alone(
    demo: Engine, one_pass: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Constrained rows beside free ones, in the passes the batch picks and with every drafting
    row in one pass (a row of lower K padded: its masks stop at its own K)."""
    if one_pass:

        def every_drafting_row(self: BatchDecoder, groups: dict[int, list]) -> list[list]:
            rows = [row for k in sorted(groups, reverse=True) for row in groups[k]]
            return [rows] if rows else []

        monkeypatch.setattr(BatchDecoder, "_passes", every_drafting_row)
    sampled = SamplingParams(temperature=0.8, top_p=0.95, seed=7)
    reqs = [
        request(demo, "Reply in JSON:", 2),
        request(demo, "The answer, as JSON:", None, sampling=sampled),
        request(demo, "def add(a, b):", 3, grammar=None, max_tokens=30, ignore_eos=True),
        request(demo, "JSON please:", 0),
        request(demo, "One more:", 3, sampling=replace(sampled, seed=3)),
    ]
    expected = [run(demo, r)[0] for r in reqs]
    got, finish = batched(demo, reqs, join_at={4: 2})
    for i, want in enumerate(expected):
        assert got[i] == want, f"row {i}"
        assert finish[i] == ("length" if i == 2 else "stop")


def test_a_grammar_that_does_not_compile_is_the_requests_error(demo: Engine) -> None:
    with pytest.raises(GrammarError, match="foo"):
        json_schema_grammar({"type": "foo"})
    bad = request(demo, "x", 0, grammar='{"grammars": [{"lark_grammar": "start: ("}]}')
    with pytest.raises(RequestError) as caught:
        next(demo.generate(bad))  # before the first event
    assert caught.value.param == "grammar"


def test_past_the_end_of_the_grammar_only_stop_ids_follow(demo: Engine) -> None:
    """With EOS ignored, a complete output is followed by stop ids alone (nothing breaks)."""
    tokens, finish, _ = run(demo, request(demo, "Reply in JSON:", 3, ignore_eos=True))
    assert finish == "length" and len(tokens) == 80
    end = next(i for i, t in enumerate(tokens) if t in demo.eos_token_ids)
    assert set(tokens[end:]) <= demo.eos_token_ids
    json.loads(demo.tokenizer.decode(tokens[:end]))


def test_rollback_restores_the_mask(demo: Engine) -> None:
    constraint: TokenConstraint = demo.constraint(GRAMMAR)
    start = constraint.allowed().copy()
    ids = demo.tokenizer.encode('{"answer": "no"', add_special_tokens=False)
    for token in ids:
        assert constraint.consume(token)
    assert not np.array_equal(constraint.allowed(), start)
    constraint.rollback(len(ids))
    assert np.array_equal(constraint.allowed(), start)


@pytest.mark.fast
def test_objects_that_list_properties_take_no_other_key() -> None:
    """Closed where the schema says nothing of other keys (pydantic's schemas), at any depth
    and in ``$defs``; left as written where it does say (``additionalProperties``,
    ``patternProperties``), where no properties are listed (any JSON object) and in the
    branches of an ``allOf``, which would otherwise refuse each other's keys."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {"at": point, "tags": {"type": "array", "items": point}},
        "$defs": {"P": point},
        "anyOf": [point],
        "allOf": [point],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    for inner in (
        closed["properties"]["at"],
        closed["properties"]["tags"]["items"],
        closed["$defs"]["P"],
        closed["anyOf"][0],
    ):
        assert inner["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0]
    assert "additionalProperties" not in schema  # the request's schema is not changed
    kept = {"type": "object", "properties": {}, "additionalProperties": {"type": "string"}}
    assert closed_objects(kept) == kept
    patterned = {"type": "object", "properties": {}, "patternProperties": {"^x": {}}}
    assert closed_objects(patterned) == patterned
    assert closed_objects({"type": "object"}) == {"type": "object"}


def test_a_forced_call_may_end_after_any_complete_call(demo: Engine) -> None:
    """``tool_choice`` required / Anthropic ``any``: after each complete call the reply may end
    (a stop id) or go on to another call; one call only (a named function, parallel calls off):
    after it, nothing but a stop id."""
    tokenizer = demo.tokenizer
    vocab = tokenizer.get_vocab()
    tools = [{"type": "function", "function": {"name": "answer", "parameters": YES_NO_TOOL}}]
    call = "<tool_call>\n<function=answer>\n<parameter=answer>\nno\n</parameter>\n</function>\n"
    ids = tokenizer.encode(call + "</tool_call>", add_special_tokens=False)
    stops = sorted(demo.eos_token_ids)
    for parallel in (True, False):
        grammar = tool_call_grammar(
            tools, (vocab["<tool_call>"], vocab["</tool_call>"]), parallel=parallel
        )
        constraint = demo.constraint(grammar)
        for _ in range(2 if parallel else 1):  # a second call after a newline, when allowed
            constraint.consume_all(ids)
            allowed = set(np.flatnonzero(constraint.allowed()).tolist())
            assert set(stops) <= allowed, parallel
            assert (allowed - set(stops) != set()) == parallel, parallel
            if parallel:
                constraint.consume_all(tokenizer.encode("\n", add_special_tokens=False))
