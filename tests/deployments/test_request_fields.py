"""The request-field table of docs/serving.md, walked: each field the table refuses gets a 400
naming it, each it honours is accepted and builds valid SamplingParams, and each honoured
with limits is refused past them. The table and the request models must list the same fields."""

import json
import re
from pathlib import Path

import pytest

from spin_cluster.deployments.errors import ApiError
from spin_cluster.deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from spin_cluster.engine import SamplingParams

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
ENDPOINTS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}
BASE = {"chat": {"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
        "completions": {"model": "m", "prompt": "Hi"}}

# field -> (a value inside the table's limits, a value past them or None where there are none)
EXAMPLES = {
    "model": ("m", None),
    "messages": ([{"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
                 [{"role": "user", "content": "Hi", "name": "bob"}]),
    "prompt": ([1, 2, 3], ["a", "b"]),
    "max_tokens": (5, None),
    "max_completion_tokens": (5, None),
    "temperature": (0.5, None),
    "top_p": (0.9, None),
    "top_k": (5, None),
    "min_tokens": (2, None),
    "n": (4, 17),
    "stream": (True, None),
    "stream_options": ({"include_usage": True, "continuous_usage_stats": True}, {"include_obfuscation": True}),
    "stop": (["\n"], None),
    "stop_token_ids": ([2], None),
    "seed": (7, None),
    "ignore_eos": (True, None),
    "logit_bias": ({"42": 5.5, "7": -100}, None),
    "presence_penalty": (0, 0.5),
    "frequency_penalty": (0, 0.5),
    "response_format": ({"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}, None),
    "logprobs": (True, None),
    "top_logprobs": (0, 21),
    "user": ("user-1", None),
    "tools": ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
              [{"type": "function", "function": {"name": "f g"}}]),
    "tool_choice": ("none", "required"),  # required without tools
    "parallel_tool_calls": (True, None),
    "echo": (True, None),
    "suffix": (None, "tail"),
    "best_of": (1, 3),
    "functions": ([{"name": "f"}], None),
    "function_call": ("auto", None),
    "repetition_penalty": (1.1, None),
    "service_tier": ("auto", None),
    "store": (True, None),
    "metadata": ({"k": "v"}, None),
    "modalities": (["text"], None),
    "audio": ({"voice": "alloy"}, None),
    "prediction": ({"type": "content", "content": "x"}, None),
    "reasoning_effort": ("low", None),
    "web_search_options": ({}, None),
}
# completions' logprobs is a count, not a flag
PAST_LIMITS = {("completions", "logprobs"): 21}


def _table() -> dict[str, dict[str, str]]:
    """field -> {"chat": yes|limits|400, "completions": ...} from the doc's field table."""
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"\| `(\w+)` \| (yes|limits|400) \| (yes|limits|400) \|", line)
        if m:
            rows[m.group(1)] = {"chat": m.group(2), "completions": m.group(3)}
    return rows


TABLE = _table()
CASES = [(endpoint, name) for name in TABLE for endpoint in ENDPOINTS]


def _body(endpoint: str, name: str, value) -> bytes:
    body = {**BASE[endpoint], name: value}  # the other endpoint's prompt field comes on top of this one's
    if name == "stream_options":
        body["stream"] = True
    return json.dumps(body).encode()


def _refusal(endpoint: str, name: str, value) -> ApiError:
    with pytest.raises(ApiError) as e:
        req = parse_body(_body(endpoint, name, value), ENDPOINTS[endpoint])
        req.to_generate("r")
    return e.value


def test_the_table_lists_every_field_of_the_request_models():
    assert len(TABLE) >= 40
    modelled = set(ChatCompletionRequest.model_fields) | set(CompletionRequest.model_fields)
    assert modelled <= set(TABLE), f"fields missing from docs/serving.md: {sorted(modelled - set(TABLE))}"
    assert set(TABLE) == set(EXAMPLES)


@pytest.mark.parametrize("endpoint, name", CASES)
def test_each_field_is_honoured_or_refused_by_name(endpoint, name):
    status = TABLE[name][endpoint]
    accepted, past_limits = EXAMPLES[name]
    if status == "400":
        err = _refusal(endpoint, name, accepted)
        assert err.status == 400 and err.param == name, err.message
        return
    req = parse_body(_body(endpoint, name, accepted), ENDPOINTS[endpoint])
    SamplingParams(**req.to_generate("r").sampling)  # the engine server builds these
    past_limits = PAST_LIMITS.get((endpoint, name), past_limits)
    if status == "limits":
        assert past_limits is not None, f"{name}: the table says limits; give a value past them"
        err = _refusal(endpoint, name, past_limits)
        assert err.status == 400 and err.param.split(".")[0] == name, err.message


def test_logit_bias_reaches_sampling_params():
    req = parse_body(_body("chat", "logit_bias", {"42": 5.5, "7": -100}), ChatCompletionRequest)
    assert SamplingParams(**req.to_generate("r").sampling).logit_bias == ((7, -100.0), (42, 5.5))


@pytest.mark.parametrize("fmt", [{"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": 3},
                                 {"type": "json_schema", "json_schema": {"name": "n", "schema": []}}])
def test_bad_response_formats_are_refused(fmt):
    assert _refusal("chat", "response_format", fmt).param == "response_format"


@pytest.mark.parametrize("bias, words", [({"abc": 5}, "'abc' is not a token id"), ({"-3": 1}, "must be >= 0"),
                                         ({"5": 101}, "in [-100, 100]")])
def test_bad_logit_bias_is_refused_naming_the_key(bias, words):
    try:
        req = parse_body(_body("completions", "logit_bias", bias), CompletionRequest)
        SamplingParams(**req.to_generate("r").sampling)
    except (ApiError, ValueError) as e:
        assert words in str(e) and "logit_bias" in str(e)
        return
    raise AssertionError(f"{bias} was accepted")
