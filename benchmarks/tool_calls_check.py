"""Tool calls through any OpenAI-compatible server, with the openai client: how many calls to a
named function parse and validate against its schema, whether ``auto`` calls a tool that fits
and answers in text when none does, and one round trip with the tool's result.

    .venv/bin/python benchmarks/tool_calls_check.py --url http://127.0.0.1:8011 [--model NAME] [--out F]
"""

from __future__ import annotations

import argparse
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import openai

from spin_cluster.provenance import provenance, write_json

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city",
                                           "parameters": SCHEMA}}]
CITIES = ["Paris", "Rome", "Oslo", "Lima", "Cairo", "Tokyo", "Delhi", "Quito", "Accra", "Hanoi",
          "Dakar", "Seoul", "Bern", "Riga", "Sofia", "Doha", "Kyiv", "Baku", "Lagos", "Perth"]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def ask(client: openai.OpenAI, model: str, text: str, **kwargs):
    return client.chat.completions.create(model=model, messages=[{"role": "user", "content": text}], tools=TOOLS,
                                          max_tokens=64, **kwargs)


def named_calls(client: openai.OpenAI, model: str) -> int:
    """Calls of 20 that parse and validate, tool_choice naming the function, temperature 0.8."""
    def one(i_city):
        i, city = i_city
        out = ask(client, model, f"What is the weather in {city}?", tool_choice=NAMED, temperature=0.8, seed=i)
        calls = out.choices[0].message.tool_calls or []
        try:
            jsonschema.validate(json.loads(calls[0].function.arguments), SCHEMA)
            return len(calls) == 1 and calls[0].function.name == "get_weather"
        except (IndexError, ValueError, jsonschema.ValidationError):
            return False

    with ThreadPoolExecutor(8) as pool:
        return sum(pool.map(one, enumerate(CITIES)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True)
    ap.add_argument("--model", default=None, help="default: the server's one model")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=600)
    model = args.model or client.models.list().data[0].id
    fits = ask(client, model, "What is the weather in Paris right now?", tool_choice="auto", temperature=0).choices[0]
    unfit = ask(client, model, "Write a haiku about the sea.", tool_choice="auto", temperature=0).choices[0]
    result = {
        "provenance": provenance(), "url": args.url, "model": model,
        "named_valid_of_20": named_calls(client, model),
        "auto_fitting": {"finish_reason": fits.finish_reason, "content": fits.message.content,
                         "tool_calls": [c.function.model_dump() for c in fits.message.tool_calls or []]},
        "auto_unfitting": {"finish_reason": unfit.finish_reason, "content": unfit.message.content,
                           "tool_calls": [c.function.model_dump() for c in unfit.message.tool_calls or []]},
    }
    if fits.message.tool_calls:  # the round trip: the call as the client got it, then its result
        follow = [{"role": "user", "content": "What is the weather in Paris right now?"}, fits.message,
                  {"role": "tool", "tool_call_id": fits.message.tool_calls[0].id, "content": "21 C, sunny"}]
        answer = client.chat.completions.create(model=model, messages=follow, tools=TOOLS, max_tokens=48,
                                                temperature=0).choices[0].message.content
        result["answer_after_the_result"] = answer
    print(json.dumps({k: v for k, v in result.items() if k != "provenance"}, indent=1))
    if args.out:
        write_json(args.out, result)


if __name__ == "__main__":
    main()
