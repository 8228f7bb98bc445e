"""Load harness for any OpenAI-compatible server (this one, or vLLM): N concurrent streaming
clients, bounded in requests and in time; prints p50/p99 TTFT and inter-token latency,
output tokens/s and errors.

    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000/v1 --clients 64 --max-tokens 32

Each client sends its share of ``--requests`` one after another, with ``stream: true`` and
``stream_options.include_usage`` (token counts from the final usage chunk; without one, one
token per content chunk). ``--ignore-eos`` (vLLM's extension, on by default) makes every
request generate exactly ``--max-tokens``. Only the given URL is contacted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from dataclasses import dataclass, field

import httpx

from spin_cluster.bench.args import add_out, save


@dataclass
class RequestResult:
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_tokens: int = 0
    e2e_s: float = 0.0


@dataclass(frozen=True)
class LoadConfig:
    url: str
    model: str | None = None
    api_key: str | None = None
    clients: int = 8
    requests: int | None = None  # total; None: one per client
    max_tokens: int = 32
    prompt: str = "Write a short story about a lighthouse keeper."
    chat: bool = False
    ignore_eos: bool = True
    timeout_s: float = 300.0


async def run_load(cfg: LoadConfig) -> dict:
    total = cfg.requests if cfg.requests is not None else cfg.clients
    headers = {"Authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
    limits = httpx.Limits(max_connections=cfg.clients + 2)
    async with httpx.AsyncClient(base_url=cfg.url.rstrip("/"), headers=headers, limits=limits,
                                 timeout=httpx.Timeout(cfg.timeout_s, connect=10)) as http:
        model = cfg.model or await _first_model(http)
        queue: asyncio.Queue[int] = asyncio.Queue()
        for i in range(total):
            queue.put_nowait(i)
        results: list[RequestResult] = []

        async def client() -> None:
            while not queue.empty():
                i = queue.get_nowait()
                results.append(await _one(http, cfg, model, i))

        start = time.perf_counter()
        tasks = [asyncio.create_task(client()) for _ in range(min(cfg.clients, total))]
        done, pending = await asyncio.wait(tasks, timeout=cfg.timeout_s)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        wall_s = time.perf_counter() - start
    unfinished = total - len(results)
    return summarize(results, wall_s, unfinished, model, cfg)


async def _first_model(http: httpx.AsyncClient) -> str:
    r = await http.get("/models")
    r.raise_for_status()
    return r.json()["data"][0]["id"]


async def _one(http: httpx.AsyncClient, cfg: LoadConfig, model: str, i: int) -> RequestResult:
    body: dict = {"model": model, "max_tokens": cfg.max_tokens, "temperature": 0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    prompt = f"{cfg.prompt} (#{i})"
    if cfg.chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    res = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with http.stream("POST", "/chat/completions" if cfg.chat else "/completions", json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    res.ok = res.error is None
                    break
                event = json.loads(data)
                if "error" in event:
                    res.error = str(event["error"].get("message"))
                    continue
                if event.get("usage"):
                    res.num_tokens = event["usage"]["completion_tokens"]
                if _content(event, cfg.chat):
                    now = time.perf_counter()
                    if res.ttft_s is None:
                        res.ttft_s = now - start
                    else:
                        res.itl_s.append(now - last)
                    last = now
                    chunks += 1
    except (httpx.HTTPError, asyncio.TimeoutError) as e:
        res.error = f"{type(e).__name__}: {e}"
    res.num_tokens = res.num_tokens or chunks
    res.e2e_s = time.perf_counter() - start
    if res.ok is False and res.error is None:
        res.error = "the stream ended without [DONE]"
    return res


def _content(event: dict, chat: bool) -> str:
    choices = event.get("choices") or []
    if not choices:
        return ""
    if chat:
        return (choices[0].get("delta") or {}).get("content") or ""
    return choices[0].get("text") or ""


def summarize(results: list[RequestResult], wall_s: float, unfinished: int, model: str, cfg: LoadConfig) -> dict:
    ok = [r for r in results if r.ok]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    tokens = sum(r.num_tokens for r in ok)
    errors = [r.error for r in results if not r.ok]
    return {
        "url": cfg.url, "model": model, "clients": cfg.clients, "max_tokens": cfg.max_tokens,
        "requests": len(results) + unfinished, "completed": len(ok), "errors": len(errors) + unfinished,
        "first_errors": errors[:3] + (["unfinished at the time limit"] * min(unfinished, 1)),
        "wall_s": wall_s, "output_tokens": tokens, "output_tokens_per_s": tokens / wall_s if wall_s else 0.0,
        "ttft_p50_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "itl_p50_s": _pct(itl, 50), "itl_p99_s": _pct(itl, 99),
        "e2e_p50_s": _pct([r.e2e_s for r in ok], 50),
    }


def _pct(values: list[float], p: float) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(p) - 1] if p < 100 else max(values)


def format_summary(s: dict) -> str:
    def ms(x: float | None) -> str:
        return "n/a" if x is None else f"{x * 1000:.0f} ms"

    lines = [
        f"url {s['url']}  model {s['model']}  clients {s['clients']}  max_tokens {s['max_tokens']}",
        f"requests {s['requests']}  completed {s['completed']}  errors {s['errors']}  wall {s['wall_s']:.1f} s",
        f"TTFT  p50 {ms(s['ttft_p50_s'])}  p99 {ms(s['ttft_p99_s'])}",
        f"ITL   p50 {ms(s['itl_p50_s'])}  p99 {ms(s['itl_p99_s'])}",
        f"E2E   p50 {ms(s['e2e_p50_s'])}",
        f"output tokens {s['output_tokens']}  ({s['output_tokens_per_s']:.1f} tok/s)",
    ]
    lines += [f"error: {e}" for e in s["first_errors"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000/v1", help="the server's /v1 base URL")
    p.add_argument("--model", default=None, help="default: the first model of GET /models")
    p.add_argument("--api-key", default=None)
    p.add_argument("--clients", type=int, default=8, help="concurrent streaming clients")
    p.add_argument("--requests", type=int, default=None, help="total requests (default: one per client)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--prompt", default=LoadConfig.prompt)
    p.add_argument("--chat", action="store_true", help="use /chat/completions")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    add_out(p, help="write the summary as JSON here")
    a = p.parse_args(argv)
    cfg = LoadConfig(url=a.url, model=a.model, api_key=a.api_key, clients=a.clients, requests=a.requests,
                     max_tokens=a.max_tokens, prompt=a.prompt, chat=a.chat, ignore_eos=a.ignore_eos,
                     timeout_s=a.timeout)
    summary = asyncio.run(run_load(cfg))
    print(json.dumps(summary, indent=2) if a.json else format_summary(summary))
    save(a, summary)
    return 0 if summary["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
