"""The OpenAI response bodies: whole responses, SSE chunks, usage, and the two logprobs shapes.

    completions  "logprobs": {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}
    chat         "logprobs": {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

With ``echo``, completions' text and logprobs start with the prompt's (its first token has no
logprob: null, as in vLLM and OpenAI).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from spin_cluster.deployments.choices import Choice
from spin_cluster.deployments.messages import Delta, TokenLogprob


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


def sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


def completion_logprobs(entries: list[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The completions shape; each top dict holds the position's own token too (vLLM's)."""
    offsets = []
    for e in entries:
        offsets.append(text_offset)
        text_offset += len(e.token)
    return {"tokens": [e.token for e in entries], "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [None if e.logprob is None else {e.token: e.logprob, **dict(e.top)} for e in entries],
            "text_offset": offsets}


def chat_logprobs(entries: list[TokenLogprob]) -> dict[str, Any]:
    def one(token: str, logprob: float) -> dict[str, Any]:
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8", "replace"))}

    return {"content": [{**one(e.token, e.logprob), "top_logprobs": [one(t, v) for t, v in e.top]} for e in entries]}


class CompletionFormat:
    """Bodies of /v1/completions. ``echo``: the prompt text that starts each choice's text
    (None: no echo); ``logprobs``: the request asked for them."""

    prefix = "cmpl"

    def __init__(self, request_id: str, model: str, *, echo: str | None = None, logprobs: bool = False) -> None:
        self.id, self.model, self.created = request_id, model, int(time.time())
        self.echo, self.logprobs = echo, logprobs

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[Choice], use: dict[str, int]) -> dict[str, Any]:
        return {**self._head("text_completion"), "choices": [self._choice(c) for c in choices], "usage": use}

    def _choice(self, c: Choice) -> dict[str, Any]:
        head = self.echo or ""
        logprobs = completion_logprobs(c.all_logprobs(self.echo is not None)) if self.logprobs else None
        return {"index": c.index, "text": head + c.text, "logprobs": logprobs, "finish_reason": c.reason}

    # ``with_usage``: the request asked for usage (``include_usage``), so every chunk has a
    # "usage" key: ``use`` (the usage so far, under ``continuous_usage_stats``) or null.
    def start_chunks(self, n: int, with_usage: bool, use: dict[str, int] | None = None) -> list[dict[str, Any]]:
        return []

    def chunks(self, choice: Choice, delta: Delta, with_usage: bool,
               use: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """The SSE chunks of one Delta of ``choice`` (already added to it): its text, then its
        finish reason in a chunk of its own. The first Delta of a choice carries the echo."""
        first = choice.num_deltas == 1
        text = (self.echo or "") + delta.text if first else delta.text
        entries = list(delta.logprobs)
        if first and self.echo is not None:
            entries = list(choice.prompt_logprobs or ()) + entries
        out = []
        if text or entries:
            offset = choice.text_offset(self.echo or "", len(text))
            logprobs = completion_logprobs(entries, offset) if self.logprobs else None
            out.append(self._chunk(choice.index, text, None, logprobs))
        if delta.finished:
            out.append(self._chunk(choice.index, "", choice.reason, None))
        return [{**c, **({"usage": use} if with_usage else {})} for c in out]

    def _chunk(self, index: int, text: str, reason: str | None, logprobs: dict | None) -> dict[str, Any]:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._head("text_completion"), "choices": [], "usage": use}


class ChatFormat(CompletionFormat):
    """Bodies of /v1/chat/completions; each choice's tool calls come from its ``Choice``."""

    prefix = "chatcmpl"

    def response(self, choices: list[Choice], use: dict[str, int]) -> dict[str, Any]:
        return {**self._head("chat.completion"), "choices": [self._choice(c) for c in choices], "usage": use}

    def _choice(self, c: Choice) -> dict[str, Any]:
        content, calls = c.message()
        message = {"role": "assistant", "content": content}
        if c.tools is not None:
            message["tool_calls"] = calls
        logprobs = chat_logprobs(c.all_logprobs(False)) if self.logprobs else None
        return {"index": c.index, "message": message, "logprobs": logprobs, "finish_reason": c.final_reason()}

    def start_chunks(self, n: int, with_usage: bool, use: dict[str, int] | None = None) -> list[dict[str, Any]]:
        return [{**self._chunk(i, {"role": "assistant", "content": ""}, None, None),
                 **({"usage": use} if with_usage else {})} for i in range(n)]

    def chunks(self, choice: Choice, delta: Delta, with_usage: bool,
               use: dict[str, int] | None = None) -> list[dict[str, Any]]:
        out = []
        logprobs = chat_logprobs(list(delta.logprobs)) if self.logprobs and delta.logprobs else None
        for part in choice.stream_deltas(delta):
            out.append(self._chunk(choice.index, part, None, logprobs))
            logprobs = None  # once, with the first part
        if logprobs is not None:  # text held back (a possible tool call): the logprobs go now
            out.append(self._chunk(choice.index, {}, None, logprobs))
        if delta.finished:
            out.append(self._chunk(choice.index, {}, choice.final_reason(), None))
        return [{**c, **({"usage": use} if with_usage else {})} for c in out]

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None, logprobs: dict | None) -> dict[str, Any]:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        return {**self._head("chat.completion.chunk"), "choices": [choice]}

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return {**self._head("chat.completion.chunk"), "choices": [], "usage": use}
