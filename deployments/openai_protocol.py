"""The OpenAI HTTP protocol: request models and their validation (the bodies of responses are
``openai_format.py``'s).

Every request field is honoured, honoured with limits, or refused with a 400 that names it;
docs/serving.md has the table. A field these models do not know is refused too (pydantic's
``extra="forbid"``), so nothing a client sends is silently dropped.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from spin_cluster.deployments import tool_calls
from spin_cluster.deployments.errors import ApiError
from spin_cluster.deployments.messages import GenerateRequest
from spin_cluster.deployments.request_body import load_json_object
from spin_cluster.deployments.tool_calls import Tool, ToolCall

# Chat without max_tokens runs to the end of the context; the engine stops there.
_UNBOUNDED_MAX_TOKENS = 1 << 30
# Most choices per request: each is a sequence of its own in the engine's batch.
MAX_N = 16
# vLLM's and OpenAI's bound on top_logprobs (the engine's MAX_LOGPROBS).
MAX_TOP_LOGPROBS = 20


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    # vLLM's: with include_usage, every chunk carries the usage so far (load tools such as
    # guidellm ask for it to count tokens as they stream).
    continuous_usage_stats: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = None
    # The newer name of max_tokens (chat's, in OpenAI's API); load tools send it to completions
    # too. max_tokens wins when both are set.
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # OpenAI's end-user id, for the caller's own abuse tracking: accepted, no effect on output.
    user: str | None = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        if not 1 <= self.n <= MAX_N:
            raise ApiError(400, f"n={self.n}: must be in [1, {MAX_N}]", param="n", code="invalid_value")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise ApiError(400, f"{name} is not supported (use 0)", param=name, code="unsupported_value")
        if self.stream_options is not None and not self.stream:
            raise ApiError(400, "stream_options is only allowed with stream=true", param="stream_options")
        structured_output(self.response_format)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """SamplingParams fields; the engine server builds them and reports bad values."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        stop = [checked_text(s, "stop") for s in stop]
        out: dict[str, Any] = {
            "max_tokens": next((n for n in (self.max_tokens, self.max_completion_tokens) if n is not None),
                               default_max_tokens),
            "stop": tuple(stop),
            "stop_token_ids": tuple(self.stop_token_ids or ()),
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "seed": self.seed,
            "logit_bias": logit_bias_ids(self.logit_bias or {}),
            "structured_output": structured_output(self.response_format),
        }
        for name in ("temperature", "top_p", "top_k"):
            if getattr(self, name) is not None:
                out[name] = getattr(self, name)
        return out

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every chunk: ``continuous_usage_stats`` with ``include_usage``, as in vLLM."""
        return self.include_usage and bool(self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of not in (None, 1):
            raise ApiError(400, "best_of is not supported (use 1)", param="best_of", code="unsupported_value")
        if self.suffix is not None:
            raise ApiError(400, "suffix is not supported", param="suffix", code="unsupported_value")
        _check_top("logprobs", self.logprobs)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        """``logprobs`` k: each token's logprob and the k most likely; with ``echo``, the
        prompt's too (vLLM's prompt_logprobs)."""
        out = super().sampling(default_max_tokens)
        out["logprobs"] = self.logprobs
        out["prompt_logprobs"] = self.logprobs if self.echo else None
        return out

    def to_generate(self, request_id: str) -> GenerateRequest:
        p = self.prompt
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, list) and p and not all(isinstance(t, int) for t in p):
            raise ApiError(400, f"{len(p)} prompts in one request: send one prompt per request",
                           param="prompt", code="unsupported_value")
        sampling = self.sampling(16)
        if isinstance(p, str):
            return GenerateRequest(request_id, sampling, prompt=checked_text(p, "prompt"), n=self.n, echo=self.echo)
        return GenerateRequest(request_id, sampling, prompt_token_ids=tuple(p), n=self.n, echo=self.echo)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    # An assistant turn's calls, and a tool turn's answer to one, as clients send them back.
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def as_dict(self, i: int) -> dict[str, Any]:
        """The message as the chat template reads it."""
        if self.tool_calls and self.role != "assistant":
            raise ApiError(400, f"messages[{i}].tool_calls: only assistant messages carry tool calls",
                           param="messages", code="invalid_value")
        out = {"role": self.role, "content": checked_text(self.text(), f"messages[{i}].content")}
        if self.tool_calls:
            out["tool_calls"] = [c.model_dump() for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ApiError(400, f"content part of type {part.get('type')!r}: only text is supported",
                               param="messages", code="unsupported_value")
            parts.append(part["text"])
        return "".join(parts)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Tool] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    def check_supported(self) -> None:
        super().check_supported()
        _check_top("top_logprobs", self.top_logprobs)
        if self.top_logprobs and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        mode = self.tool_mode()[0]
        if mode in ("required", "named") and structured_output(self.response_format) is not None:
            raise ApiError(400, f"tool_choice={self.tool_choice!r} constrains the output itself; drop response_format",
                           param="tool_choice", code="invalid_value")

    def tool_mode(self) -> tuple[str, str | None]:
        """(none | auto | required | named, the named function)."""
        return tool_calls.choice_mode(self.tools, self.tool_choice)

    def sampling(self, default_max_tokens: int) -> dict[str, Any]:
        out = super().sampling(default_max_tokens)
        out["logprobs"] = (self.top_logprobs or 0) if self.logprobs else None
        forced = tool_calls.constraint(*self.tool_mode(), self.tools or [], self.parallel_tool_calls)
        if forced is not None:
            out["structured_output"] = forced
        return out

    def to_generate(self, request_id: str) -> GenerateRequest:
        sampling = self.sampling(_UNBOUNDED_MAX_TOKENS)
        messages = tuple(m.as_dict(i) for i, m in enumerate(self.messages))
        tools = tuple(t.model_dump(exclude_none=True) for t in self.tools) if self.tools else None
        return GenerateRequest(request_id, sampling, messages=messages, tools=tools, n=self.n)


# UTF-16 halves; json.loads joins an escaped pair (\ud83d\ude00) into one character, so any
# left in a string stood alone, which no tokenizer can encode.
_SURROGATE = re.compile("[\ud800-\udfff]")


def checked_text(text: str, param: str) -> str:
    """``text``, or a 400 saying where it holds an unpaired surrogate."""
    found = _SURROGATE.search(text)
    if found:
        raise ApiError(400, f"{param} holds an unpaired surrogate (U+{ord(found.group()):04X}) at position "
                       f"{found.start()}; send valid Unicode text", param=param, code="invalid_value")
    return text


def _check_top(name: str, value: int | None) -> None:
    if value is not None and not 0 <= value <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name}={value}: must be in [0, {MAX_TOP_LOGPROBS}]", param=name, code="invalid_value")


def structured_output(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """response_format as SamplingParams' structured_output fields (None: free text); a 400
    naming response_format for any other shape. Whether a schema compiles, the engine says."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"kind": "json_object"}
    spec = response_format.get("json_schema") if kind == "json_schema" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("schema", {}), dict):
        raise ApiError(400, 'response_format: use {"type": "text"}, {"type": "json_object"} or {"type": '
                       '"json_schema", "json_schema": {"name": ..., "schema": {...}}}', param="response_format",
                       code="invalid_value")
    # No schema: any JSON (OpenAI's own default).
    return {"kind": "json_schema", "schema": json.dumps(spec.get("schema", {}), sort_keys=True)}


def logit_bias_ids(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's string keys as token ids; a key that is not an integer is a 400 naming it.
    The engine checks the ids against its vocabulary and the biases' range."""
    out = {}
    for key, value in bias.items():
        try:
            out[int(key)] = value
        except ValueError:
            raise ApiError(400, f"logit_bias: key {key!r} is not a token id (an integer, as a string)",
                           param="logit_bias", code="invalid_value") from None
    return out


def parse_body(raw: bytes, model: type[_Common]) -> _Common:
    data = load_json_object(raw)
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"]) or None
        msg = first["msg"]
        if first["type"] == "extra_forbidden":
            msg = "this server does not support this field; remove it (docs/serving.md lists the fields)"
        raise ApiError(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value") from None
    req.check_supported()
    return req
