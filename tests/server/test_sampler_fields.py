"""The sampler fields are declared once (``sampling.params.SamplingParams``) and checked once.

Each API's request schema, its /openapi.json entry and the ``generate`` CLI's flags are
generated from ``SAMPLER_FIELDS``; a value outside a field's bound is one 400 naming the field,
in each API's own error shape; and a request's sampler is built (so checked) exactly once.
"""

from __future__ import annotations

import argparse
from typing import Any

import httpx
import pytest
from fake_engine import FakeEngine, LiveServer
from pydantic import BaseModel

import sampling.params
from sampling.params import SAMPLER_FIELDS, SamplerField, SamplingOverrides, SamplingParams
from server.adapters.anthropic.schemas import MessagesRequest
from server.adapters.openai.responses_schemas import ResponsesRequest
from server.adapters.openai.schemas import ChatCompletionRequest, CompletionRequest
from server.app import create_app
from server.settings import ServerSettings

ALL = {f.name for f in SAMPLER_FIELDS}
RESPONSES = {"temperature", "top_p", "top_k", "min_p"}
MESSAGES = {"temperature", "top_p", "top_k"}

#: request model, the sampler fields its wire format has, the fields with an API-own maximum
SCHEMAS: list[tuple[type[BaseModel], set[str], dict[str, float]]] = [
    (ChatCompletionRequest, ALL, {"temperature": 2}),
    (CompletionRequest, ALL, {"temperature": 2}),
    (ResponsesRequest, RESPONSES, {"temperature": 2}),
    (MessagesRequest, MESSAGES, {}),
]

#: path, a valid body without sampler fields, the sampler fields of that API
ENDPOINTS: list[tuple[str, dict[str, Any], set[str]]] = [
    (
        "/v1/chat/completions",
        {"model": "fake-model", "messages": [{"role": "user", "content": "TRIGGER_PLAIN"}]},
        ALL,
    ),
    ("/v1/completions", {"model": "fake-model", "prompt": "TRIGGER_PLAIN"}, ALL),
    ("/v1/responses", {"model": "fake-model", "input": "TRIGGER_PLAIN"}, RESPONSES),
    (
        "/v1/messages",
        {
            "model": "fake-model",
            "max_tokens": 8,
            "messages": [{"role": "user", "content": "TRIGGER_PLAIN"}],
        },
        MESSAGES,
    ),
]


def out_of_bound(spec: SamplerField) -> float | int:
    """A value below the field's bound (every field has a lower one); 5 below, as top_k's
    -1 is vLLM's spelling of "off" and so not an error."""
    assert spec.bound.low is not None, spec.name
    value = spec.bound.low - 5
    return int(value) if spec.type is int else float(value)


@pytest.fixture(scope="module")
def server():
    with LiveServer(create_app(FakeEngine(), ServerSettings(model="fake-model"))) as srv:
        yield srv


@pytest.mark.parametrize("model,names,wire_max", SCHEMAS, ids=[s[0].__name__ for s in SCHEMAS])
def test_each_schema_has_exactly_its_fields_of_the_definition(
    model: type[BaseModel], names: set[str], wire_max: dict[str, float]
) -> None:
    assert ALL & set(model.model_fields) == names
    props = model.model_json_schema()["properties"]
    for spec in SAMPLER_FIELDS:
        if spec.name not in names:
            continue
        info = model.model_fields[spec.name]
        assert info.annotation == (spec.type | None), spec.name
        assert info.default is None  # None: not sent, the layer below shows through
        assert props[spec.name]["description"] == spec.description
        maxima = [t.get("maximum") for t in props[spec.name]["anyOf"] if "maximum" in t]
        assert maxima == ([wire_max[spec.name]] if spec.name in wire_max else [])


def test_openapi_document_lists_the_sampler_fields_with_types(http: httpx.Client) -> None:
    doc = http.get("/openapi.json").json()
    json_type = {int: "integer", float: "number"}
    for path, _, names in ENDPOINTS:
        ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        props = doc["components"]["schemas"][ref["$ref"].rsplit("/", 1)[1]]["properties"]
        assert ALL & set(props) == names, path
        for spec in SAMPLER_FIELDS:
            if spec.name in names:
                types = {t["type"] for t in props[spec.name]["anyOf"]}
                assert types == {json_type[spec.type], "null"}, (path, spec.name)


CASES = [
    (path, body, spec)
    for path, body, names in ENDPOINTS
    for spec in SAMPLER_FIELDS
    if spec.name in names
]


@pytest.mark.parametrize(
    "path,body,spec", CASES, ids=[f"{path} {spec.name}" for path, _, spec in CASES]
)
def test_an_out_of_bound_value_is_one_400_naming_the_field(
    http: httpx.Client, path: str, body: dict[str, Any], spec: SamplerField
) -> None:
    r = http.post(path, json=body | {spec.name: out_of_bound(spec)})
    assert r.status_code == 400, r.text
    if path == "/v1/messages":  # Anthropic's shape has no param: the message starts with it
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error"
        assert err["message"].startswith(f"{spec.name}: "), err
    else:
        err = r.json()["error"]
        assert (err["param"], err["code"]) == (spec.name, "invalid_value"), err


def test_a_request_builds_its_sampler_once(
    http: httpx.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The one check: the sampler is built once per request (n = 1), from all its layers."""
    built: list[SamplingParams] = []
    check = SamplingParams.__post_init__

    def counted(self: SamplingParams) -> None:
        check(self)
        built.append(self)

    monkeypatch.setattr(sampling.params.SamplingParams, "__post_init__", counted)
    path, body, _ = ENDPOINTS[0]
    r = http.post(path, json=body | {"temperature": 0.5, "top_k": 10**9, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert [(p.temperature, p.top_k) for p in built] == [(0.5, 0)]  # top_k >= vocab: off


def test_a_sampler_that_exists_is_valid() -> None:
    for spec in SAMPLER_FIELDS:
        with pytest.raises(sampling.params.SamplingParamError) as err:
            SamplingParams(**{spec.name: out_of_bound(spec)})
        assert err.value.param == spec.name
        SamplingParams(**{spec.name: spec.default})


def test_generate_flags_are_the_definition() -> None:
    from mtpserve.cli import add_sampling_arguments, sampling_overrides

    parser = argparse.ArgumentParser()
    add_sampling_arguments(parser)
    unset = vars(parser.parse_args([]))
    assert set(unset) >= ALL and all(unset[name] is None for name in ALL)
    every = [x for spec in SAMPLER_FIELDS for x in ("--" + spec.name.replace("_", "-"), "1")]
    given = vars(parser.parse_args(every))
    assert {name: type(given[name]) for name in ALL} == {f.name: f.type for f in SAMPLER_FIELDS}
    help_text = " ".join(parser.format_help().split())
    assert all(spec.description in help_text for spec in SAMPLER_FIELDS)
    args = parser.parse_args(["--temperature", "0.5", "--top-k", "7"])
    assert sampling_overrides(args) == SamplingOverrides(temperature=0.5, top_k=7)


def test_overrides_copy_and_pickle_as_values() -> None:
    """SamplingOverrides is generated, not a dataclass: copying must still work (an engine's
    sampling_defaults may be copied or sent to another process)."""
    import copy
    import pickle

    layer = SamplingOverrides(temperature=0.5, logit_bias={3: 1.0})
    assert pickle.loads(pickle.dumps(layer)) == layer == copy.deepcopy(layer)
    assert (layer.temperature, layer.top_k) == (0.5, None)
