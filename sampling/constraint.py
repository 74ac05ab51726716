"""Structured output: a grammar every generated token must keep to (llguidance).

A request's ``response_format`` (JSON schema or any JSON object) becomes an llguidance grammar
(``json_schema_grammar``); the engine follows it with a ``TokenConstraint`` per sequence, which
says which tokens may come next (``allowed``) and advances over the tokens chosen.

Why this keeps speculation exact: masking a distribution is part of the target distribution.
Plain constrained decoding samples position t from p_t restricted to the tokens the grammar
allows after x_<t. A drafting cycle verifies position i with the mask computed after the drafts
d_1..d_i-1 (the constraint advances over each draft and is rolled back after the cycle), so each
verified position sees exactly the mask plain decoding would see there, and the rejection
sampler's guarantee (output ~ p) holds for the masked p. Drafts are drawn from the head's
distribution under the same mask (better acceptance; any q keeps the output exact). A draft the
grammar does not allow (the head drafts over a smaller vocabulary that may hold none of the
allowed tokens) has p = 0 under the mask, so it is rejected for certain and no later position
of that cycle is ever used: the masks past it are never read.

This module does not import mlx: the server builds and checks grammars with it before a
request is queued.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import numpy as np

try:  # llguidance is a dependency; the import guard keeps the error readable if it is missing
    from llguidance import LLMatcher, LLTokenizer
except ImportError as exc:  # pragma: no cover
    raise ImportError("structured output needs llguidance (pip install llguidance)") from exc

#: The grammar of ``response_format: {"type": "json_object"}``: any JSON object.
JSON_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}
#: JSON is written on one line with Python's separators. With free whitespace between tokens
#: (llguidance's default) a model can spend its whole budget on spaces and newlines, which small
#: models do; a schema's own ``x-guidance`` options still take precedence.
JSON_LAYOUT: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """A schema or grammar llguidance cannot compile (the client's 400)."""


class GrammarDeadEnd(GrammarError):
    """The grammar allows no token after the output so far: a schema llguidance accepts can
    still describe no finite JSON (``{"$ref": "#"}``). The request's own fault, never its
    neighbours'."""


def json_schema_grammar(schema: dict[str, Any], reasoning_end: int | None = None) -> str:
    """A JSON schema -> the llguidance grammar that generates JSON valid under it.

    ``reasoning_end``: the id of the token that closes a thinking model's reasoning (Qwen's
    ``</think>``) when the reply starts inside it. The reasoning is then free text (any token
    but the special ones: the model cannot stop before it has answered), the grammar starts
    after that token and the blank line Qwen's template puts after it.

    An object schema that lists ``properties`` and says nothing of ``additionalProperties``
    takes no other key (``closed_objects``).

    Raises ``GrammarError`` with llguidance's message for a schema it cannot compile (an
    unknown type, a broken ``$ref``, a keyword it does not support)."""

    schema = closed_objects(schema)

    def build() -> str:
        if reasoning_end is None:
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
        laid_out = {"x-guidance": JSON_LAYOUT} | schema
        return LLMatcher.grammar_from_lark(
            f'start: REASONING <[{int(reasoning_end)}]> "\\n\\n" answer\n'
            "REASONING: /(?s:.*)/\n"
            f"answer: %json {json.dumps(laid_out)}\n"
        )

    return _checked(build, "unsupported JSON schema")


#: keywords whose value is a map of names to subschemas / a list of subschemas / one subschema
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SUBSCHEMAS = (
    "items",
    "additionalProperties",
    "additionalItems",
    "unevaluatedItems",
    "contains",
    "not",
    "if",
    "then",
    "else",
    "propertyNames",
)
#: keywords that already say which other keys an object may have
_OPEN_KEYWORDS = ("additionalProperties", "patternProperties", "unevaluatedProperties")


def closed_objects(schema: dict[str, Any], *, in_all_of: bool = False) -> dict[str, Any]:
    """``schema`` with ``additionalProperties: false`` on every object schema that lists
    ``properties`` and leaves other keys unsaid, as OpenAI's strict mode and vLLM read it.

    JSON Schema lets such an object hold any other key, and a grammar that allows them lets a
    small model write keys until its budget runs out (repeating one, which a JSON parser then
    reads as the last value). Pydantic, instructor and ``llm --schema`` send such schemas and
    expect their fields only. The branches of an ``allOf`` stay open: each would otherwise
    refuse the keys of the others."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SUBSCHEMA_MAPS and isinstance(value, dict):
            value = {k: _closed(v) for k, v in value.items()}
        elif key in _SUBSCHEMA_LISTS and isinstance(value, list):
            value = [_closed(v, in_all_of=key == "allOf") for v in value]
        elif key in _SUBSCHEMAS:
            value = _closed(value)
        out[key] = value
    if "properties" in out and not in_all_of and not any(k in out for k in _OPEN_KEYWORDS):
        out["additionalProperties"] = False
    return out


def _closed(value: Any, *, in_all_of: bool = False) -> Any:
    return closed_objects(value, in_all_of=in_all_of) if isinstance(value, dict) else value


def tool_call_grammar(
    tools: list[dict[str, Any]],
    call_ids: tuple[int, int],
    reasoning_end: int | None = None,
    parallel: bool = True,
    answer_schema: dict[str, Any] | None = None,
) -> str:
    """The grammar of a reply that must call tools (``tool_choice`` required or a named
    function): one or more of Qwen's XML tool calls (the chat template's format; the blocks
    ``server.core.toolcalls`` parses) of the tools given, and nothing else. With
    ``answer_schema`` (structured output beside tools the model may call: an agent with an
    output type) the reply is either those calls or JSON valid under that schema, laid out as
    ``json_schema_grammar`` lays it out.

    ``call_ids``: the ids of the ``<tool_call>`` and ``</tool_call>`` tokens. A function whose
    JSON schema lists properties takes them in the schema's order, each at most once, every
    required one present; a value is written in the form the tool-call parser reads
    (``value_is_json``): text for a string (one of its ``enum`` when it has one; otherwise
    free text up to the closing tag) and JSON valid under the property's schema for every
    other type (free text where llguidance cannot enforce that schema). A function
    without a schema takes any parameter names with free-text values. ``parallel``: several
    calls in a row may follow (one only when false). ``reasoning_end`` as in
    ``json_schema_grammar``."""
    open_id, close_id = (int(i) for i in call_ids)
    rules = [
        'calls: call ("\\n" call)*' if parallel else "calls: call",
        f'call: <[{open_id}]> "\\n<function=" function "</function>\\n" <[{close_id}]>',
        f"function: {' | '.join(f'f{i}' for i in range(len(tools)))}",
        # a value and its closing tag in one lexeme: text ending at the first "\n</parameter>\n"
        # (a free-text lexeme followed by the tag would be greedy and run past it; a `stop=`
        # string cannot be rolled back, which every drafting cycle does)
        r"TEXT_VALUE: /(?s:.*\n<\/parameter>\n)/ & ~/(?s:.*\n<\/parameter>\n.+)/",
    ]
    # JSON values: (rule, its parameter's opening tag, the property's schema on its own)
    typed: list[tuple[str, str, dict[str, Any]]] = []
    for i, tool in enumerate(tools):
        name = json.dumps(tool["function"]["name"], ensure_ascii=False)
        parameters = tool["function"].get("parameters") or {}
        properties = parameters.get("properties")
        if not isinstance(properties, dict):  # no schema of its arguments: any names
            rules.append(
                f'f{i}: {name} ">\\n" p{i}*\n'
                f'p{i}: "<parameter=" /[A-Za-z_][A-Za-z0-9_.-]*/ ">\\n" TEXT_VALUE'
            )
            continue
        required = set(parameters.get("required") or ())
        body = []
        for j, (key, schema) in enumerate(properties.items()):
            rule = f"p{i}_{j}"
            tag = json.dumps(f"<parameter={key}>\n", ensure_ascii=False)
            schema = schema if isinstance(schema, dict) else {}
            if value_is_json(schema):
                typed.append((rule, tag, _standalone(schema, parameters)))
            elif _string_choices(schema):
                choices = " | ".join(json.dumps(c, ensure_ascii=False) for c in schema["enum"])
                rules.append(f'{rule}: {tag} ({choices}) "\\n</parameter>\\n"')
            else:
                rules.append(f"{rule}: {tag} TEXT_VALUE")
            body.append(rule if key in required else f"{rule}?")
        rules.append(f'f{i}: {name} ">\\n" {" ".join(body)}'.rstrip())
    reply = "calls"
    if answer_schema is not None:
        laid_out = {"x-guidance": JSON_LAYOUT} | closed_objects(answer_schema)
        rules.append(f"answer: %json {json.dumps(laid_out)}")
        reply = "(calls | answer)"
    start = f"start: {reply}"
    if reasoning_end is not None:
        start = f'start: REASONING <[{int(reasoning_end)}]> "\\n\\n" {reply}\nREASONING: /(?s:.*)/'

    def lark(free: set[str]) -> str:
        """The grammar with the JSON values of the rules in ``free`` written as free text."""
        values = []
        for rule, tag, schema in typed:
            if rule in free:
                values.append(f"{rule}: {tag} TEXT_VALUE")
            else:
                values.append(f'{rule}: {tag} j{rule} "\\n</parameter>\\n"')
                values.append(f"j{rule}: %json {json.dumps(schema)}")
        return "\n".join([start, *rules, *values]) + "\n"

    what = "cannot constrain a reply to calls of these tools"
    try:
        return _checked(lambda: LLMatcher.grammar_from_lark(lark(set())), what)
    except GrammarError:
        # a property schema llguidance cannot enforce is free text, as it is without a forced
        # call; the other values stay typed
        free = {rule for rule, _, schema in typed if not _compiles(schema)}
        return _checked(lambda: LLMatcher.grammar_from_lark(lark(free)), what)


def value_is_json(schema: dict[str, Any]) -> bool:
    """Whether a tool-call parameter with this schema is written as JSON (True) or as text:
    Qwen's tool calls carry a string argument as it is and anything else as JSON (a template
    may write a boolean as ``True``; the parser reads both)."""
    return declared_type(schema) not in ("", "string")


def declared_type(schema: dict[str, Any]) -> str:
    """A tool parameter's type as the tool-call grammar and parser read it: the schema's
    ``type``, the first that is not ``"null"`` when it lists several; "" when it names none
    (such a value is read as text)."""
    kind = schema.get("type")
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), None)
    return kind if isinstance(kind, str) else ""


def _string_choices(schema: dict[str, Any]) -> bool:
    """A text value that must be one of its ``enum`` strings (a single line each)."""
    choices = schema.get("enum")
    return (
        isinstance(choices, list)
        and bool(choices)
        and all(isinstance(c, str) and "\n" not in c for c in choices)
    )


def _standalone(schema: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """A property's schema compiled on its own: the function's ``$defs`` / ``definitions``
    carried along (its ``$ref``s point at the root) and the JSON laid out on one line."""
    shared = {k: parameters[k] for k in ("$defs", "definitions") if k in parameters}
    return {"x-guidance": JSON_LAYOUT} | shared | schema


def _compiles(schema: dict[str, Any]) -> bool:
    try:
        _checked(lambda: LLMatcher.grammar_from_json_schema(json.dumps(schema)), "")
    except GrammarError:
        return False
    return True


def _checked(build: Callable[[], str], what: str) -> str:
    """``build()``'s grammar once llguidance has validated it; ``GrammarError`` (prefixed with
    ``what``) for anything it refuses, including a panic in its Rust code."""
    try:
        grammar = build()
        error = LLMatcher.validate_grammar(grammar)
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"{what}: {exc}") from exc
    except BaseException as exc:  # pyo3's PanicException derives from BaseException
        if type(exc).__name__ != "PanicException":
            raise
        raise GrammarError(f"{what}: {exc}") from exc
    if error:
        raise GrammarError(f"{what}: {error}")
    return grammar


def build_tokenizer(hf_tokenizer: Any, vocab_size: int, stop_ids: frozenset[int]) -> LLTokenizer:
    """llguidance's view of the model's tokenizer (built once per engine: ~0.1-1 s).

    ``stop_ids`` are the ids that end a generation: the grammar lets them through once the
    output is complete, and only them."""
    from llguidance.hf import from_tokenizer

    return from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=sorted(stop_ids))


class TokenConstraint:
    """One sequence's position in a grammar: the tokens allowed next, advanced token by token.

    ``allowed()`` is a boolean vector over the model's vocabulary. Once the output is complete
    the grammar allows the stop ids alone; after that nothing more is consumed (a request that
    ignores EOS keeps drawing stop ids instead of breaking the text).
    """

    def __init__(self, tokenizer: LLTokenizer, grammar: str, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.grammar = grammar
        self.vocab_size = vocab_size
        #: every token consumed so far: an llguidance error is sticky (no rollback out of it),
        #: so a state is rebuilt from these when a draft led into a dead end
        self.consumed: list[int] = []
        self.matcher = self._new_matcher()

    def _new_matcher(self) -> LLMatcher:
        try:
            matcher = LLMatcher(self.tokenizer, self.grammar)
        except (TypeError, ValueError) as exc:
            raise GrammarError(str(exc)) from exc
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return matcher

    def copy(self) -> TokenConstraint:
        """An independent constraint at the same position (one per choice of a request)."""
        twin = object.__new__(TokenConstraint)
        twin.tokenizer, twin.grammar = self.tokenizer, self.grammar
        twin.vocab_size = self.vocab_size
        twin.consumed = list(self.consumed)
        twin.matcher = self.matcher.deep_copy()
        return twin

    def allowed(self) -> np.ndarray:
        """``[vocab_size]`` bool: the tokens that may come next; ``GrammarDeadEnd`` when none
        may (never a draw from no tokens)."""
        bits = np.frombuffer(self.matcher.compute_bitmask(), dtype=np.uint8)
        allowed = np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)
        if self.matcher.is_error() or not allowed.any():
            raise GrammarDeadEnd(
                f"the output grammar allows no token after {len(self.consumed)} generated "
                "tokens: the schema describes no JSON that can be completed"
            )
        return allowed

    def consume(self, token: int) -> bool:
        """Advance over ``token``, which ``allowed()`` allowed; False when the grammar had
        already stopped (nothing consumed, nothing to roll back). ``GrammarDeadEnd`` when the
        grammar cannot take it (it was drawn past a dead end)."""
        if self.matcher.is_error():  # (an errored matcher also reports itself stopped)
            raise GrammarDeadEnd(
                f"the output grammar allows no token after {len(self.consumed)} generated "
                "tokens: the schema describes no JSON that can be completed"
            )
        if self.matcher.is_stopped():
            return False
        if not self.matcher.consume_token(token):
            raise GrammarDeadEnd(
                f"the output grammar allows no token after {len(self.consumed)} generated "
                "tokens: the schema describes no JSON that can be completed"
            )
        if self.matcher.is_error():
            raise GrammarDeadEnd(f"the output grammar refused token {token}")
        self.consumed.append(token)
        return True

    def consume_all(self, tokens: list[int]) -> None:
        """Advance over tokens drawn under this constraint's masks (a cycle's commit)."""
        for token in tokens:
            self.consume(token)

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` consumed tokens (a cycle's drafts); out of an error state (a
        draft that led into a dead end) by replaying the tokens before them."""
        if not n:
            return
        kept = self.consumed[: len(self.consumed) - n]
        if not self.matcher.is_error() and self.matcher.rollback(n):
            self.consumed = kept
            return
        self.matcher, self.consumed = self._new_matcher(), []
        for token in kept:
            self.consume(token)
