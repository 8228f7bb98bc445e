"""The OpenAI API of a real Serve app (SmolLM2, Spin's offloaded cache, Quest), through the
openai client, against the engine's own output for the same config."""

import asyncio
import json

import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from spin_cluster.config import SpinConfig
from spin_cluster.deployments.settings import load_app_config
from spin_cluster.engine import Engine, SamplingParams

from .conftest import API_KEY, APP, RayLogs, engine_handle, wait_engine_idle

# Ray's own log when a stream's result lands on a future its awaiter already cancelled (the
# client left at that instant): raylet's callback, not this package's code, and harmless.
RAY_CANCELLED_CALLBACK = re.compile(
    r"failed to run async callback \(user func\)\s*Traceback \(most recent call last\):.*?"
    r"InvalidStateError: CANCELLED: <Future at 0x[0-9a-f]+ state=cancelled>", re.S)

# A real Serve cluster; the timeout (which includes starting it) stops a hang, not a slow run.
pytestmark = [pytest.mark.serve, pytest.mark.timeout(600)]

MODEL = "smollm2"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
# Past sink + budget + local (112 tokens): Quest really selects pages for this one.
LONG_PROMPT = "The river runs through the old town, past the mill and the church. " * 12 + "Then"
MESSAGES = [{"role": "user", "content": "Name three colours."}]
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def client(spin_app):
    base, _ = spin_app
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def engine(spin_app):
    """The same config's engine, in this process."""
    _, args = spin_app
    spin: SpinConfig = load_app_config(args).spin
    return Engine(spin, progress=False)


GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list().data] == [MODEL]


@pytest.mark.parametrize("prompt", [*PROMPTS, LONG_PROMPT])
def test_greedy_completion_equals_the_engine(client, engine, prompt):
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0)
    ref = engine.generate([prompt], GREEDY)[0]
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids)
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_chat_equals_the_engine(client, engine):
    out = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0)
    ref = engine.chat(MESSAGES, GREEDY)
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref.text
    assert out.usage.prompt_tokens == len(engine.tokenizer.chat_prompt_ids(MESSAGES))
    assert out.usage.completion_tokens == len(ref.token_ids)


def test_token_id_prompt(client, engine):
    ids = engine.tokenizer.encode(PROMPTS[0])
    out = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert out.choices[0].text == engine.generate([ids], SamplingParams(temperature=0, max_tokens=8))[0].text


def test_streamed_chat_equals_the_plain_answer_and_ends_with_usage(client, engine):
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    ref = engine.chat(MESSAGES, GREEDY)
    assert text == ref.text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == ref.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(ref.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_counts_the_tokens_as_they_stream(client, engine):
    # vLLM's stream_options.continuous_usage_stats (guidellm sends it): usage in every chunk
    stream = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True},
    )
    chunks = list(stream)
    counts = [c.usage.completion_tokens for c in chunks]
    prompt = len(engine.tokenizer.chat_prompt_ids(MESSAGES))
    assert counts[0] == 0 and counts == sorted(counts) and counts[-1] == len(engine.chat(MESSAGES, GREEDY).token_ids)
    assert all(c.usage.prompt_tokens == prompt and c.usage.total_tokens == prompt + n for c, n in zip(chunks, counts))


def test_streamed_completion_ends_with_done(spin_app):
    base, _ = spin_app
    body = {"model": MODEL, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{base}/v1/completions", json=body, headers=_auth(), timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line]
    assert events[-1] == "data: [DONE]"
    assert all(e.startswith("data: ") for e in events)


def test_the_planner_routes_to_the_engine_replica_it_hears_from(spin_app):
    from ray import serve

    planner = serve.get_deployment_handle("ClusterPlanner", app_name=APP)
    info = engine_handle(APP).replica_info.remote().result(timeout_s=30)
    engine_id = info["replica_id"]
    assert info["step_threads"].startswith("StepThreads(small=1, ")  # the default "auto", on the CPU
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp_on = "[never]" not in f.read()
    # THP_MEM_ALLOC_ENABLE: the weights and the KV pool sit on huge pages where the kernel allows
    assert (info["huge_pages_mb"] > 100) == thp_on, info["huge_pages_mb"]
    reports = planner.live_reports.remote().result(timeout_s=30)
    assert [r.replica_id for r in reports] == [engine_id] and reports[0].free_kv_tokens > 0
    assert planner.route.remote(10).result(timeout_s=30) == engine_id


def test_n_past_sixteen_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, n=17)
    assert e.value.status_code == 400 and e.value.body["param"] == "n"


def test_logit_bias_steers_the_tokens(client, engine):
    forced = engine.tokenizer.encode(" banana")[-1]
    out = client.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=4, temperature=0,
                                    logit_bias={str(forced): 100})
    assert engine.tokenizer.encode(out.choices[0].text) == [forced] * 4


# ---- bad input: status and OpenAI error body ---------------------------------------------

_BAD = {
    "unknown model": ({"model": "gpt-5", "prompt": "Hi"}, 400, "model"),
    "negative temperature": ({"model": MODEL, "prompt": "Hi", "temperature": -1}, 400, "temperature"),
    "top_p zero": ({"model": MODEL, "prompt": "Hi", "top_p": 0}, 400, "top_p"),
    "max_tokens zero": ({"model": MODEL, "prompt": "Hi", "max_tokens": 0}, 400, "max_tokens"),
    "wrong type": ({"model": MODEL, "prompt": "Hi", "max_tokens": "many"}, 400, "max_tokens"),
    "missing prompt": ({"model": MODEL}, 400, "prompt"),
    "empty prompt": ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    "prompt over the context": ({"model": MODEL, "prompt": "hello " * 1100}, 400, "prompt"),
    "two prompts": ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    "n past 16": ({"model": MODEL, "prompt": "Hi", "n": 17}, 400, "n"),
    "logprobs past 20": ({"model": MODEL, "prompt": "Hi", "logprobs": 21}, 400, "logprobs"),
    "logit_bias key not a token id": ({"model": MODEL, "prompt": "Hi", "logit_bias": {"abc": 5}}, 400, "logit_bias"),
    "logit_bias key outside the vocabulary": ({"model": MODEL, "prompt": "Hi", "logit_bias": {"999999": 5}}, 400,
                                              "logit_bias"),
    "logit_bias over 100": ({"model": MODEL, "prompt": "Hi", "logit_bias": {"5": 101}}, 400, "logit_bias"),
    "an unknown field": ({"model": MODEL, "prompt": "Hi", "repetition_penalty": 1.2}, 400, "repetition_penalty"),
}


@pytest.mark.parametrize("case", sorted(_BAD))
def test_bad_completion_request(spin_app, case):
    body, status, param = _BAD[case]
    r = httpx.post(f"{spin_app[0]}/v1/completions", json=body, headers=_auth(), timeout=60)
    _assert_error(r, status)
    assert r.json()["error"]["param"] == param


def test_bad_chat_requests(spin_app):
    url = f"{spin_app[0]}/v1/chat/completions"
    for body in ({"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]},
                 {"model": MODEL, "messages": MESSAGES, "stream_options": {"include_usage": True}}):
        _assert_error(httpx.post(url, json=body, headers=_auth(), timeout=60), 400)


def test_malformed_json_is_400(spin_app):
    r = httpx.post(f"{spin_app[0]}/v1/completions", content=b"{not json", timeout=30,
                   headers={**_auth(), "content-type": "application/json"})
    _assert_error(r, 400)
    assert r.json()["error"]["code"] == "invalid_json"


def test_body_over_the_limit_is_413(spin_app):
    limit = 4 * 2**20
    body = b'{"model": "smollm2", "prompt": "' + b"a" * limit + b'"}'
    r = httpx.post(f"{spin_app[0]}/v1/completions", content=body, timeout=60,
                   headers={**_auth(), "content-type": "application/json"})
    _assert_error(r, 413)


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}])
def test_api_key_is_required_on_v1(spin_app, headers):
    base = spin_app[0]
    _assert_error(httpx.get(f"{base}/v1/models", headers=headers, timeout=30), 401)
    _assert_error(httpx.post(f"{base}/v1/completions", json={"model": MODEL, "prompt": "Hi"}, headers=headers,
                             timeout=30), 401)
    assert httpx.get(f"{base}/health", timeout=30).status_code == 200  # not under /v1


def test_unknown_route_is_a_json_404(spin_app):
    _assert_error(httpx.get(f"{spin_app[0]}/v1/nothing", headers=_auth(), timeout=30), 404)


# ---- the malformed-body sweep: every answer a 4xx (or a 200), with a JSON error, never a 5xx --

def _nested(levels: int, opener: str, closer: str) -> bytes:
    return f'{{"model": "{MODEL}", "max_tokens": 1, "messages": {opener * levels}0{closer * levels}}}'.encode()


_WRONG_VALUES = [{"x": 1}, ["x"], "x", 1.5, -1, 2**64, None, True, "\ud800"]
_COMPLETION = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
_CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "max_completion_tokens": 1}
_FIELDS = ["model", "max_tokens", "temperature", "top_p", "top_k", "min_tokens", "n", "stream", "stream_options",
           "stop", "stop_token_ids", "seed", "ignore_eos", "presence_penalty", "frequency_penalty", "best_of", "user"]


def _sweep_bodies() -> list[tuple[str, bytes]]:
    """(path, raw body): deep nesting, a wrong value in every field, bytes that are not UTF-8,
    unpaired surrogates, numbers JSON does not have."""
    comp, chat = "/v1/completions", "/v1/chat/completions"
    bodies = [(chat, _nested(n, o, c)) for n in (100, 2_000, 100_000) for o, c in (("[", "]"), ('{"a":', "}"))]
    fields = [(comp, _COMPLETION, f) for f in [*_FIELDS, "prompt", "echo", "suffix", "logprobs"]]
    fields += [(chat, _CHAT, f) for f in [*_FIELDS, "messages", "max_completion_tokens", "logprobs", "tools"]]
    for path, base, field in fields:
        bodies += [(path, json.dumps({**base, field: value}).encode()) for value in _WRONG_VALUES]
    for field in ("role", "content"):
        bodies += [(chat, json.dumps({**_CHAT, "messages": [{"role": "user", "content": "Hi", field: value}]}).encode())
                   for value in _WRONG_VALUES]
    prefix = f'{{"model": "{MODEL}", "max_tokens": 1, "prompt": '.encode()
    bodies += [(comp, prefix + raw + b"}") for raw in (
        b'"\xff\xfe"', b'"\xc0\xaf"', b'"\xe2\x82"', b'"\ud800"', b'"a\udc00b"', b'"\ud83d"', b"NaN",
        b"Infinity", b"-Infinity", b"1" * 5000, b"[" + b",".join([b"1" * 30] * 3) + b"]")]
    bodies += [(chat, json.dumps({**_CHAT, "messages": [{"role": "user", "content": "Hi \udc00"}]}).encode()),
               (comp, json.dumps({**_COMPLETION, "\ud800": 1}).encode()), (comp, b"\xff" * 64), (comp, b"")]
    return bodies


def test_malformed_bodies_never_get_a_5xx(spin_app):
    base = spin_app[0]
    answers = asyncio.run(_post_all(base, _sweep_bodies()))
    for (path, body), (status, content) in zip(_sweep_bodies(), answers):
        where = f"{path} {body[:120]!r}: {status} {content[:300]!r}"
        assert status in (200, 400), where  # 200: a wrong-looking value that is valid (null, "x" as a stop)
        if status == 400:
            err = json.loads(content)["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["message"], where
    deep = answers[:6]  # 100 levels is past the limit too
    assert all(json.loads(c)["error"]["message"].startswith("the body nests") for _, c in deep), deep


def test_an_unpaired_surrogate_is_named_with_its_position(spin_app):
    for path, body, param in (
        ("/v1/completions", {**_COMPLETION, "prompt": "ab\ud800"}, "prompt"),
        ("/v1/chat/completions", {**_CHAT, "messages": [{"role": "user", "content": "ok"},
                                                        {"role": "user", "content": "x\udfff"}]},
         "messages[1].content"),
    ):
        r = httpx.post(f"{spin_app[0]}{path}", content=json.dumps(body), timeout=60,
                       headers={**_auth(), "content-type": "application/json"})
        _assert_error(r, 400)
        assert r.json()["error"]["param"] == param
        position = 2 if param == "prompt" else 1
        assert f"{param} holds an unpaired surrogate (U+" in r.json()["error"]["message"]
        assert f"at position {position}" in r.json()["error"]["message"]


async def _post_all(base: str, bodies: list[tuple[str, bytes]]) -> list[tuple[int, bytes]]:
    headers = {**_auth(), "content-type": "application/json"}
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120) as http:

        async def one(path: str, body: bytes) -> tuple[int, bytes]:
            async with gate:
                r = await http.post(path, content=body)
                return r.status_code, r.content

        return await asyncio.wait_for(asyncio.gather(*(one(p, b) for p, b in bodies)), 300)


# ---- disconnects -----------------------------------------------------------------------

def test_fifty_abandoned_streams_free_every_page_and_log_no_traceback(spin_app):
    base, _ = spin_app
    before = wait_engine_idle(APP)
    aborted_before = _aborted_count(base)
    logs = RayLogs()
    asyncio.run(_abandon_streams(base, 50))
    after = wait_engine_idle(APP)  # polls until nothing runs: each was aborted, none finished
    assert after["num_free_pages"] == after["num_total_pages"] == before["num_total_pages"]
    assert _aborted_count(base) - aborted_before == 50
    time.sleep(1)  # log lines reach their files
    new = logs.new_text()
    new = RAY_CANCELLED_CALLBACK.sub("", new)
    assert "Traceback" not in new, new[new.find("Traceback") - 2000:][:6000]
    assert logs.new_text(under="serve").count("client disconnected") == 50  # one line each


def _aborted_count(base: str) -> float:
    text = httpx.get(f"{base}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "spin_request_success_total" and sample.labels.get("finished_reason") == "abort":
                return sample.value
    return 0.0


async def _abandon_streams(base: str, count: int) -> None:
    body = {"model": MODEL, "prompt": "Tell me a very long story.", "max_tokens": 500, "min_tokens": 500,
            "stream": True}
    limits = httpx.Limits(max_connections=count)
    async with httpx.AsyncClient(base_url=base, headers=_auth(), timeout=120, limits=limits) as http:

        async def one() -> None:
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    if line.startswith("data: {"):
                        return  # leave mid-stream: the connection closes here

        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(count))), 300)


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def _assert_error(r: httpx.Response, status: int) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]


# ---- structured outputs --------------------------------------------------------------------

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"]}
PERSON_FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
PERSON_ASK = [{"role": "user", "content": "Give me a person as JSON with name and age."}]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_json_schema_validates(client, stream):
    import jsonschema

    kwargs = dict(model=MODEL, messages=PERSON_ASK, max_tokens=64, temperature=0.7, seed=3,
                  response_format=PERSON_FORMAT)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kwargs)
                       if c.choices)
    else:
        text = client.chat.completions.create(**kwargs).choices[0].message.content
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize("stream", [False, True])
def test_completion_json_object_is_an_object(client, stream):
    kwargs = dict(model=MODEL, prompt="A person as JSON: ", max_tokens=64, temperature=0,
                  extra_body={"response_format": {"type": "json_object"}})
    if stream:
        text = "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices)
    else:
        text = client.completions.create(**kwargs).choices[0].text
    assert isinstance(json.loads(text), dict)


def test_a_schema_that_does_not_compile_is_400_saying_why(client):
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=PERSON_ASK, max_tokens=8, response_format=bad)
    assert e.value.body["param"] == "response_format" and "cannot be compiled" in e.value.body["message"]
