"""Request validation and response bodies of the OpenAI protocol, without a server."""

import json

import pytest

from spin_cluster.deployments.errors import ApiError
from spin_cluster.deployments.choices import Choice
from spin_cluster.deployments.messages import Delta, TokenLogprob
from spin_cluster.deployments.openai_format import ChatFormat, CompletionFormat, usage
from spin_cluster.deployments.openai_protocol import ChatCompletionRequest, CompletionRequest, parse_body
from spin_cluster.deployments.request_body import load_json_object
from spin_cluster.engine import SamplingParams


def _parse(model, body):
    return parse_body(json.dumps(body).encode(), model)


def _error(model, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        _parse(model, body) if isinstance(body, dict) else parse_body(body, model)
    return e.value


def test_completion_maps_to_sampling_params_fields():
    req = _parse(CompletionRequest, {"model": "m", "prompt": "Hi", "temperature": 0, "stop": "\n", "top_k": 5,
                                     "seed": 3, "ignore_eos": True, "min_tokens": 2, "max_tokens": 9})
    gen = req.to_generate("cmpl-1")
    params = SamplingParams(**gen.sampling)
    assert (params.temperature, params.top_k, params.seed, params.stop) == (0, 5, 3, ("\n",))
    assert (params.max_tokens, params.min_tokens, params.ignore_eos) == (9, 2, True)
    assert gen.prompt == "Hi" and gen.request_id == "cmpl-1"


def test_completion_defaults_to_16_tokens_and_chat_to_the_context():
    assert _parse(CompletionRequest, {"model": "m", "prompt": "Hi"}).to_generate("a").sampling["max_tokens"] == 16
    chat = _parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}]})
    assert chat.to_generate("b").sampling["max_tokens"] >= 2**20
    capped = _parse(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                                            "max_completion_tokens": 7})
    assert capped.to_generate("c").sampling["max_tokens"] == 7


def test_token_prompts_and_one_element_lists():
    assert _parse(CompletionRequest, {"model": "m", "prompt": [1, 2, 3]}).to_generate("a").prompt_token_ids == (1, 2, 3)
    assert _parse(CompletionRequest, {"model": "m", "prompt": [[4, 5]]}).to_generate("a").prompt_token_ids == (4, 5)
    assert _parse(CompletionRequest, {"model": "m", "prompt": ["x"]}).to_generate("a").prompt == "x"


def test_chat_text_parts_are_joined():
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hel"}, {"type": "text", "text": "lo"}]}]})
    assert req.to_generate("a").messages == ({"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "Hello"})


@pytest.mark.parametrize("model, body, param", [
    (CompletionRequest, b"{oops", None),
    (CompletionRequest, b"[1, 2]", None),
    (CompletionRequest, {"prompt": "Hi"}, "model"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "n": 17}, "n"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "n": 0}, "n"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "best_of": 3}, "best_of"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "logprobs": 21}, "logprobs"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "echo": [1]}, "echo"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "presence_penalty": 0.5}, "presence_penalty"),
    (CompletionRequest, {"model": "m", "prompt": "Hi", "stream_options": {"include_usage": True}}, "stream_options"),
    (ChatCompletionRequest, {"model": "m", "messages": []}, "messages"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{}]}, "tools"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "logprobs": True,
                             "top_logprobs": 21}, "top_logprobs"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tool_choice": "required"},
     "tool_choice"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     "tool_choice"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"}, "tool_choice"),
    (ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [
        {"type": "function", "function": {"name": "has space"}}]}, "tools"),
])
def test_refused_requests_are_400_with_the_param(model, body, param):
    err = _error(model, body)
    assert err.status == 400 and err.type == "invalid_request_error"
    assert (err.param or "").split(".")[0] == (param or "")  # tools.0.type names tools' first entry
    assert set(err.body()["error"]) == {"message", "type", "param", "code"}


def test_image_parts_are_refused_when_converted():
    req = _parse(ChatCompletionRequest, {"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(ApiError, match="only text"):
        req.to_generate("a")


def test_response_bodies():
    use = usage(3, 4)
    assert use == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}
    chat = ChatFormat("chatcmpl-1", "m")
    body = chat.response([_choice(0, Delta("Hi", (5,), True, "stop"))], use)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {"role": "assistant", "content": "Hi"}
    first = chat.start_chunks(1, True)[0]
    assert first["choices"][0]["delta"]["role"] == "assistant" and first["usage"] is None
    assert chat.usage_chunk(use)["choices"] == []
    comp = CompletionFormat("cmpl-1", "m")
    a = Delta("a", (7,), False, None)
    assert comp.chunks(_choice(0, a), a, False)[0]["choices"][0]["text"] == "a"
    assert "usage" not in comp.chunks(_choice(0, a), a, False)[0]
    assert comp.chunks(_choice(0, a), a, True)[0]["usage"] is None
    assert comp.chunks(_choice(0, a), a, True, use)[0]["usage"] == use and chat.start_chunks(1, True, use)[0]["usage"] == use


def _choice(index, *deltas):
    choice = Choice(index)
    for d in deltas:
        choice.add(d)
    return choice


def test_echo_and_logprobs_bodies_of_two_choices():
    prompt = (TokenLogprob("Hi", None), TokenLogprob(" there", -2.0, ((" you", -1.0),)))
    d0 = Delta("!", (0,), True, "stop", 0, (TokenLogprob("!", -0.5, (("!", -0.5),)),), prompt)
    d1 = Delta("?", (1,), True, "length", 1, (TokenLogprob("?", -1.5, (("!", -0.5),)),), prompt)
    comp = CompletionFormat("cmpl-1", "m", echo="Hi there", logprobs=True)
    body = comp.response([_choice(0, d0), _choice(1, d1)], usage(2, 2))
    assert [c["text"] for c in body["choices"]] == ["Hi there!", "Hi there?"]
    assert [c["finish_reason"] for c in body["choices"]] == ["stop", "length"]
    lp = body["choices"][1]["logprobs"]
    assert lp == {"tokens": ["Hi", " there", "?"], "token_logprobs": [None, -2.0, -1.5],
                  "top_logprobs": [None, {" there": -2.0, " you": -1.0}, {"?": -1.5, "!": -0.5}],
                  "text_offset": [0, 2, 8]}
    streamed = comp.chunks(_choice(1, d1), d1, False)
    assert [c["choices"][0]["text"] for c in streamed] == ["Hi there?", ""]
    assert streamed[0]["choices"][0]["logprobs"]["tokens"] == ["Hi", " there", "?"]
    chat = ChatFormat("chatcmpl-1", "m", logprobs=True).response([_choice(0, d0)], usage(2, 1))
    assert chat["choices"][0]["logprobs"] == {"content": [{"token": "!", "logprob": -0.5, "bytes": [33], "top_logprobs": [
        {"token": "!", "logprob": -0.5, "bytes": [33]}]}]}


@pytest.mark.parametrize("options, include, continuous", [
    ({"include_usage": True, "continuous_usage_stats": True}, True, True),
    ({"include_usage": True}, True, False),
    ({"continuous_usage_stats": True}, False, False),  # vLLM's: no usage asked for, none sent
])
def test_continuous_usage_needs_include_usage(options, include, continuous):
    body = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stream_options": options}
    req = _parse(ChatCompletionRequest, body)
    assert (req.include_usage, req.continuous_usage) == (include, continuous)


@pytest.mark.parametrize("raw, words", [
    (b'{"a": ' + b"[" * 33 + b"]" * 33 + b"}", "more than 32 levels"),
    (b'{"a": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "more than 32 levels"),
    (b'{"a": NaN}', "NaN is not a JSON number"),
    (b'{"a": -Infinity}', "-Infinity is not a JSON number"),
    (b'{"a": 9223372036854775808}', "outside the signed 64-bit range"),
    (b'{"a": ' + b"7" * 5000 + b"}", "not valid JSON"),
    (b'{"a": "\xff"}', "not valid UTF-8"),
])
def test_bodies_past_the_shape_limits_are_400(raw, words):
    with pytest.raises(ApiError, match=words) as e:
        load_json_object(raw)
    assert e.value.status == 400


def test_a_body_at_the_depth_limit_loads():
    raw = b'{"a": ' + b"[" * 31 + b"]" * 31 + b', "b": -9223372036854775808}'
    assert load_json_object(raw)["b"] == -(2**63)


def test_unpaired_surrogates_are_refused_with_their_position():
    with pytest.raises(ApiError, match=r"prompt holds an unpaired surrogate \(U\+DC00\) at position 3") as e:
        _parse(CompletionRequest, {"model": "m", "prompt": "abc\udc00"}).to_generate("a")
    assert e.value.param == "prompt"
    assert _parse(CompletionRequest, {"model": "m", "prompt": "ok \ud83d\ude00"}).to_generate("a").prompt == "ok 😀"
    chat = {"model": "m", "messages": [{"role": "user", "content": "x"}, {"role": "user", "content": "\ud800"}]}
    with pytest.raises(ApiError, match=r"messages\[1\]\.content holds an unpaired surrogate"):
        _parse(ChatCompletionRequest, chat).to_generate("a")
    with pytest.raises(ApiError, match="stop holds an unpaired surrogate"):
        _parse(CompletionRequest, {"model": "m", "prompt": "x", "stop": ["\ud800"]}).to_generate("a")


def test_an_error_quoting_a_surrogate_still_encodes():
    body = ApiError(400, "model '\ud800' is not served here").response().body
    assert json.loads(body)["error"]["message"] == "model '\ud800' is not served here"
