"""What vLLM users' tools send, against a real Serve app (SmolLM2 on the paged cache with prefix
caching, float32 pages) through the openai client: logprobs against transformers' own
log-softmax, echo with the prompt's logprobs, n choices whose prompt is computed once, aborted
n=4 streams that leave no page behind, and tool calls."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from spin_cluster.tokenizer import Tokenizer

from .conftest import API_KEY, wait_engine_idle, wait_healthy

pytestmark = [pytest.mark.serve, pytest.mark.timeout(900)]

APP = "paged"
MODEL = "smollm2"
PAGE = 16
MESSAGES = [{"role": "user", "content": "Name three colours."}]
PROMPT = "The capital of France is Paris, and the capital of Italy is"


@pytest.fixture(scope="module")
def paged_app(serve_port, smollm2_path):
    from ray import serve

    from spin_cluster.deployments.app import build_app

    args = {
        "config": "default",
        "model": {"path": smollm2_path, "device": "cpu", "dtype": "float32", "max_model_len": 1024},
        # float32 pages: the logprobs are compared with transformers' float32 ones
        "cache": {"page_size": PAGE, "kv_cache_gib": 0.25, "kv_cache_dtype": "auto", "enable_prefix_caching": True},
        "scheduler": {"max_num_seqs": 32, "max_num_batched_tokens": 1024},
        "serve": {"model_name": MODEL, "engine_num_cpus": 1.0, "handle_timeout_s": 60, "token_timeout_s": 60},
    }
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    base = f"http://127.0.0.1:{serve_port}/{APP}"
    wait_healthy(base)
    yield base
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(paged_app):
    return openai.OpenAI(base_url=f"{paged_app}/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def hf(smollm2_path, hf_logprobs):
    """(tokenizer, ids -> [T, V] transformers log_softmax, greedy continuation of ids)."""

    def greedy(ids, n):
        with torch.no_grad():
            out = hf_logprobs.model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
        return out[0, len(ids):].tolist()

    return Tokenizer(smollm2_path), hf_logprobs, greedy


# ---- logprobs --------------------------------------------------------------------------------

def _check_position(tok, row, token_id, token, logprob, top):
    """One position's (token, logprob, [(token, logprob)] top) against transformers' row."""
    assert token == tok.hf_tokenizer.decode([token_id])
    assert abs(logprob - row[token_id].item()) < 1e-3
    values, ids = row.topk(len(top))
    assert [t for t, _ in top][:3] == [tok.hf_tokenizer.decode([i]) for i in ids.tolist()[:3]]
    assert max(abs(v - r) for (_, v), r in zip(top, values.tolist())) < 1e-3


@pytest.mark.parametrize("stream", [False, True])
def test_chat_top_logprobs_equal_transformers(client, hf, stream):
    tok, logprobs, greedy = hf
    prompt = tok.chat_prompt_ids(MESSAGES)
    kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=20)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        out = client.chat.completions.create(**kwargs)
        content, text = out.choices[0].logprobs.content, out.choices[0].message.content
    ids = greedy(prompt, 8)
    ref = logprobs(prompt + ids)[len(prompt) - 1 : -1]
    assert len(content) == 8 and text == tok.decode(ids)
    for entry, row, token_id in zip(content, ref, ids):
        assert len(entry.top_logprobs) == 20 and entry.bytes == list(entry.token.encode())
        _check_position(tok, row, token_id, entry.token, entry.logprob,
                        [(t.token, t.logprob) for t in entry.top_logprobs])


@pytest.mark.parametrize("stream", [False, True])
def test_completion_echo_gives_the_prompts_logprobs_then_the_outputs(client, hf, stream):
    tok, logprobs, greedy = hf
    prompt = tok.encode(PROMPT)
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=2, temperature=0, logprobs=5, echo=True)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        text = "".join(c.text for c in chunks)
        parts = [c.logprobs for c in chunks if c.logprobs]
        tokens = [t for p in parts for t in p.tokens]
        token_logprobs = [v for p in parts for v in p.token_logprobs]
        top = [t for p in parts for t in p.top_logprobs]
    else:
        choice = client.completions.create(**kwargs).choices[0]
        text, tokens = choice.text, choice.logprobs.tokens
        token_logprobs, top = choice.logprobs.token_logprobs, choice.logprobs.top_logprobs
    ids = prompt + greedy(prompt, 2)
    ref = logprobs(ids)
    assert text == tok.decode(prompt) + tok.decode(ids[len(prompt):])
    assert len(tokens) == len(ids) and token_logprobs[0] is None and top[0] is None
    for i in range(1, len(ids)):
        # each top dict holds the 5 most likely and the position's own token
        ranked = sorted(top[i].items(), key=lambda kv: -kv[1])
        _check_position(tok, ref[i - 1], ids[i], tokens[i], token_logprobs[i], ranked[:5])


# ---- n -----------------------------------------------------------------------------------------

def _counter(base: str, name: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def _wait_counter(base: str, name: str, above: float) -> float:
    """The engines' counters reach /metrics with their next report."""
    for _ in range(40):
        value = _counter(base, name)
        if value > above:
            return value
        asyncio.run(asyncio.sleep(0.25))
    return _counter(base, name)


@pytest.mark.parametrize("stream", [False, True])
def test_n_choices_compute_the_prompt_once(paged_app, client, hf, stream):
    tok = hf[0]
    prompt = f"{PROMPT} {'streamed' if stream else 'whole'}: " + "a long shared context. " * 20
    num_prompt = len(tok.encode(prompt))
    hits = _counter(paged_app, "spin_prefix_cache_hits_total")
    kwargs = dict(model=MODEL, prompt=prompt, max_tokens=12, temperature=0.8, seed=5, n=4)
    if stream:
        chunks = [c.choices[0] for c in client.completions.create(stream=True, **kwargs) if c.choices]
        texts = {i: "".join(c.text for c in chunks if c.index == i) for i in range(4)}
        reasons = {c.index: c.finish_reason for c in chunks if c.finish_reason}
    else:
        out = client.completions.create(**kwargs)
        assert [c.index for c in out.choices] == [0, 1, 2, 3]
        texts = {c.index: c.text for c in out.choices}
        reasons = {c.index: c.finish_reason for c in out.choices}
        assert out.usage.prompt_tokens == num_prompt and 4 <= out.usage.completion_tokens <= 4 * 12
    assert set(reasons) == {0, 1, 2, 3} and set(reasons.values()) <= {"stop", "length"}
    assert len(set(texts.values())) == 4  # seed + i: four different draws
    # choices 1-3 took every full page of the prompt (all but its last token) from choice 0
    expected = 3 * ((num_prompt - 1) // PAGE) * PAGE
    assert _wait_counter(paged_app, "spin_prefix_cache_hits_total", hits + expected - 1) - hits == expected


def test_a_seeded_choice_is_reproducible(client):
    kwargs = dict(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0.8, seed=11)
    four = client.completions.create(n=4, **kwargs).choices
    again = client.completions.create(n=2, **kwargs).choices
    assert [c.text for c in again] == [c.text for c in four[:2]]


def test_aborted_n4_streams_leave_no_page_behind(paged_app):
    asyncio.run(_abandon(paged_app, 6))
    info = wait_engine_idle(APP)  # the integrity check raises on a leaked or doubled page
    assert info["num_free_pages"] == info["num_total_pages"]


async def _abandon(base: str, count: int) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 400, "min_tokens": 400,
            "n": 4, "temperature": 0.8, "stream": True}
    headers = {"Authorization": f"Bearer {API_KEY}"}
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:

        async def one(seen: int) -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        seen -= 1
                        if seen == 0:
                            return  # leave mid-stream: the connection closes here

        # some leave at their first chunk (choices 1-3 still waiting for choice 0's prompt), some later
        await asyncio.wait_for(asyncio.gather(*(one(1 + 8 * i) for i in range(count))), 300)


# ---- tool calls --------------------------------------------------------------------------------

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 20},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city", "unit"],
    "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "Add two integers", "parameters": {
             "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
             "required": ["a", "b"]}}}]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Accra", "Hanoi",
          "Dakar", "Seoul", "Bern", "Riga", "Sofia", "Doha", "Kyiv", "Baku", "Lagos", "Perth"]


def test_a_named_function_call_validates_in_20_of_20(client):
    def ask(city: str):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"What is the weather in {city}?"}], tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "get_weather"}}, max_tokens=64, temperature=0.8,
            seed=len(city))

    async def all_cities():
        return await asyncio.gather(*(asyncio.to_thread(ask, c) for c in CITIES))

    answers = asyncio.run(all_cities())
    valid = 0
    for out in answers:
        (call,) = out.choices[0].message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("chatcmpl-tool-")
        jsonschema.validate(json.loads(call.function.arguments), WEATHER)
        valid += 1
    assert valid == 20


def test_streamed_named_call_arrives_as_deltas(client):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                  tool_choice={"type": "function", "function": {"name": "add"}}, max_tokens=32, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0].message.tool_calls[0]
    chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
    deltas = [d for c in chunks for d in (c.delta.tool_calls or [])]
    assert deltas[0].function.name == "add" and deltas[0].id.startswith("chatcmpl-tool-")
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments
    assert all(d.index == 0 for d in deltas) and len(deltas) > 2  # argument text as it is generated
    jsonschema.validate(json.loads(whole.function.arguments), TOOLS[1]["function"]["parameters"])


def test_required_makes_calls_that_parse(client):
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Weather in Oslo?"}],
                                         tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                         max_tokens=64, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
    jsonschema.validate(json.loads(call.function.arguments), schema)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_answers_without_a_call_when_no_tool_fits(client, stream):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Write a haiku about the sea."}],
                  tools=TOOLS, tool_choice="auto", max_tokens=24, temperature=0)
    if stream:
        chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        assert not any(c.delta.tool_calls for c in chunks)
        text, reason = "".join(c.delta.content or "" for c in chunks), chunks[-1].finish_reason
    else:
        message = client.chat.completions.create(**kwargs).choices[0]
        assert message.message.tool_calls == []
        text, reason = message.message.content, message.finish_reason
    assert text and "<tool_call>" not in text and reason in ("stop", "length")


def test_a_tool_result_goes_back_to_the_model(client):
    """The openai client's own objects, end to end: the call it got, then the result."""
    ask = [{"role": "user", "content": "What is the weather in Rome?"}]
    first = client.chat.completions.create(model=MODEL, messages=ask, tools=TOOLS, max_tokens=48, temperature=0,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}})
    message = first.choices[0].message
    follow = [*ask, message, {"role": "tool", "tool_call_id": message.tool_calls[0].id, "content": "21 C, sunny"}]
    second = client.chat.completions.create(model=MODEL, messages=follow, tools=TOOLS, max_tokens=16, temperature=0,
                                            tool_choice="none")
    assert second.choices[0].message.content and second.choices[0].message.tool_calls == []
    assert second.usage.prompt_tokens > first.usage.prompt_tokens


@pytest.mark.parametrize("body, param", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/nowhere"}}}],
      "tool_choice": "required"}, "tools"),  # the grammar engine's own refusal of the schema
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"n": 17}, "n"),
])
def test_bad_tool_and_logprob_fields_are_400_naming_them(client, body, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=4, extra_body=body)
    assert e.value.body["param"].split(".")[0] == param
