"""One choice of a response, as its Deltas arrive: text, token count, logprobs, finish reason,
and (chat with tools) its tool calls, parsed at the end or streamed as OpenAI's deltas.

Streaming a chat choice with tools (``stream_deltas``):

    named     every Delta's text is more of the call's arguments: the first delta names the
              function, the rest carry arguments
    required  held until the end (a JSON array of calls), then one delta per call
    auto      content streams until a ``<tool_call>`` may begin (a tail that could start one
              waits for more text), and not at all when it starts as a JSON object (a bare
              call may follow); the calls, if any, come at the end
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from spin_cluster.deployments import tool_calls
from spin_cluster.deployments.messages import Delta, TokenLogprob


@dataclass
class Choice:
    index: int
    # (mode, function name, the tools' names) of a chat request with tools (mode and name:
    # ``tool_calls.choice_mode``); None without.
    tools: tuple[str, str | None, tuple[str, ...]] | None = None
    parts: list[str] = field(default_factory=list)
    num_tokens: int = 0
    num_deltas: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: tuple[TokenLogprob, ...] | None = None
    reason: str | None = None
    _streamed: int = 0  # characters of the text already sent (as content or arguments)
    _parsed: tuple[str | None, list[dict[str, Any]]] | None = None

    def add(self, delta: Delta) -> None:
        self.parts.append(delta.text)
        self.num_tokens += len(delta.token_ids)
        self.num_deltas += 1
        self.logprobs.extend(delta.logprobs)
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.finished:
            self.reason = delta.finish_reason or "stop"

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def all_logprobs(self, with_prompt: bool) -> list[TokenLogprob]:
        return [*(self.prompt_logprobs or ()), *self.logprobs] if with_prompt else list(self.logprobs)

    def text_offset(self, echo: str, chunk_chars: int) -> int:
        """Where the last chunk of ``chunk_chars`` characters starts in the choice's text."""
        return len(echo) + sum(len(p) for p in self.parts) - chunk_chars

    # ---- tool calls ---------------------------------------------------------------------------

    def message(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the finished choice."""
        if self.tools is None:
            return self.text, []
        if self._parsed is None:
            self._parsed = tool_calls.parse(self.text, *self.tools)
        return self._parsed

    def final_reason(self) -> str | None:
        if self.tools is None or self.reason is None:
            return self.reason
        return tool_calls.finish_reason(self.tools[0], self.message()[1], self.reason)

    def stream_deltas(self, delta: Delta) -> list[dict[str, Any]]:
        """The chat deltas (``{"content": ...}`` or ``{"tool_calls": [...]}``) that ``delta``
        (already added) releases."""
        mode = self.tools[0] if self.tools else "none"
        if mode == "named":
            return self._argument_deltas(delta.text)
        text = self.text
        upto = len(text) if mode == "none" else (self._content_end(text) if mode == "auto" else 0)
        if delta.finished and mode != "none":
            content, calls = self.message()
            if not calls:
                upto = len(text)
        out = [{"content": text[self._streamed : upto]}] if upto > self._streamed else []
        self._streamed = max(self._streamed, upto)
        if delta.finished and mode in ("auto", "required"):
            out += [{"tool_calls": [{"index": i, **call}]} for i, call in enumerate(self.message()[1])]
        return out

    def _argument_deltas(self, text: str) -> list[dict[str, Any]]:
        if self._streamed == 0:
            self._streamed = 1
            call = tool_calls.parse("", "named", self.tools[1])[1][0]
            call["function"]["arguments"] = text
            return [{"tool_calls": [{"index": 0, **call}]}]
        return [{"tool_calls": [{"index": 0, "function": {"arguments": text}}]}] if text else []

    @staticmethod
    def _content_end(text: str) -> int:
        """How much of ``text`` is surely content: none if it opens a JSON object, else up to a
        ``<tool_call>``, or to a tail that could be the start of one."""
        start = text.find(tool_calls.CALL_START)
        if start >= 0:
            return start
        if text.lstrip().startswith("{"):
            return 0
        for keep in range(min(len(tool_calls.CALL_START) - 1, len(text)), 0, -1):
            if tool_calls.CALL_START.startswith(text[-keep:]):
                return len(text) - keep
        return len(text)
