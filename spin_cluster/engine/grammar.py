"""Structured outputs: a request's JSON grammar, compiled once and matched token by token.

``StructuredOutput`` says what a request's output must be (any JSON object, or JSON valid
against a schema). ``Grammars`` owns the xgrammar compiler for one tokenizer and a matcher per
constrained request. Each step the engine calls ``mask`` once for the batch before sampling
(one bitmask row per constrained request, applied to the logits where they are, CPU or GPU),
then ``accept`` with each constrained request's sampled token; a request whose matcher has
terminated is finished.

xgrammar is imported when the first constrained request arrives: unconstrained serving does
not need it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

KINDS = ("json_object", "json_schema")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must be."""

    # "json_object": any JSON object; "json_schema": JSON valid against ``schema``.
    kind: str
    # The JSON schema as canonical JSON text (sorted keys), so equal schemas share a grammar.
    schema: str | None = None
    # The request field the schema came from, which an error names: response_format, or tools
    # (a forced tool call's arguments).
    source: str = "response_format"

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"response_format={self.kind!r}: choose one of {', '.join(KINDS)}")
        if (self.kind == "json_schema") != (self.schema is not None):
            raise ValueError("response_format: json_schema needs a schema; json_object takes none")

    @classmethod
    def from_schema(cls, schema: dict[str, Any]) -> StructuredOutput:
        return cls("json_schema", json.dumps(schema, sort_keys=True))


class Grammars:
    """Compiled grammars for one tokenizer (cached by ``StructuredOutput``) and the live
    matchers of the constrained requests."""

    def __init__(self, hf_tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._hf_tokenizer = hf_tokenizer
        self.vocab_size = vocab_size  # the logits' width, which may exceed the tokenizer's
        # The engine's end-of-sequence ids (the model config's and the tokenizer's). The
        # grammar allows them only where its output is complete. Left to xgrammar, the stop
        # set is the tokenizer's alone, and any other id the engine stops on (a config's
        # second EOS, say) is an ordinary token that a string may hold: the engine then ends
        # the request mid-string, with text that does not parse.
        self.stop_token_ids = list(stop_token_ids)
        self._compiler = None
        self._compiled: dict[StructuredOutput, Any] = {}
        self._matchers: dict[str, Any] = {}
        self._bitmask: torch.Tensor | None = None  # [rows, ceil(V / 32)] int32, grown on demand
        self.refused = 0  # sampled tokens a grammar refused (each ended its request): 0 unless a mask failed

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def start(self, request_id: str, spec: StructuredOutput) -> None:
        """A matcher for this request; ValueError naming response_format when the schema does
        not compile."""
        import xgrammar as xgr

        self._matchers[request_id] = xgr.GrammarMatcher(self.compile(spec))

    def compile(self, spec: StructuredOutput) -> Any:
        grammar = self._compiled.get(spec)
        if grammar is None:
            grammar = self._compiled[spec] = self._compile(spec)
        return grammar

    def _compile(self, spec: StructuredOutput) -> Any:
        compiler = self._get_compiler()
        # Compact JSON: with free whitespace a small model can emit blank lines forever.
        try:
            if spec.kind == "json_object":
                return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
            return compiler.compile_json_schema(spec.schema, any_whitespace=False)
        except (RuntimeError, ValueError) as e:
            reason = str(e).strip().splitlines()[-1]
            raise ValueError(f"{spec.source}: the JSON schema cannot be compiled: {reason}") from None

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            info = xgr.TokenizerInfo.from_huggingface(self._hf_tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self.stop_token_ids or None)
            self._compiler = xgr.GrammarCompiler(info, max_threads=1)
        return self._compiler

    def mask(self, logits: torch.Tensor, request_ids: list[str]) -> None:
        """logits: [B, V], row i for request_ids[i]; the constrained rows' disallowed tokens
        become -inf, in one bitmask apply for the batch."""
        rows = [i for i, rid in enumerate(request_ids) if rid in self._matchers]
        if not rows:
            return
        import xgrammar as xgr

        bitmask = self._bitmask_rows(len(request_ids))  # [B, ceil(V / 32)] int32 on the host
        for i in rows:
            self._matchers[request_ids[i]].fill_next_token_bitmask(bitmask, i)
        bitmask = bitmask.to(logits.device, non_blocking=True)
        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=self.vocab_size, indices=rows)

    def _bitmask_rows(self, n: int) -> torch.Tensor:
        if self._bitmask is None or self._bitmask.shape[0] < n:
            import xgrammar as xgr

            self._bitmask = xgr.allocate_token_bitmask(n, self.vocab_size)
        return self._bitmask[:n]

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advance the request's matcher; True once its grammar has terminated (the output is
        complete). A token the grammar refuses ends the request too, rather than producing
        output that does not match (it can only happen past a ban the mask did not see)."""
        matcher = self._matchers[request_id]
        if not matcher.accept_token(token_id):
            self.refused += 1
            return True
        return matcher.is_terminated()

    def is_complete(self, request_id: str) -> bool:
        """The output so far is a full match (the grammar would accept a stop token now)."""
        return self._matchers[request_id].is_completed()

    def forget(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)
