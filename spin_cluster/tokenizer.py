"""The model folder's tokenizer and chat template (a request's incremental detokenization is
``spin_cluster.engine.detokenizer``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        # transformers is used for its tokenizer loading only (tokenizer.json, chat template).
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(str(path))
        self.eos_token_id: int | None = self._tok.eos_token_id

    @property
    def hf_tokenizer(self):
        """The transformers tokenizer (a grammar compiler reads its vocabulary)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=True))

    def decode(self, token_ids: list[int]) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=True)

    def has_chat_template(self) -> bool:
        return bool(getattr(self._tok, "chat_template", None))

    def template_lists_tools(self) -> bool:
        """The chat template has a tools section of its own (Qwen2.5's, Llama 3's do)."""
        return "tools" in (getattr(self._tok, "chat_template", None) or "")

    def apply_chat_template(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        if not self.has_chat_template():
            raise ValueError("this model's folder has no chat template; use plain completions")
        return self._tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    def chat_prompt_ids(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
        # The template already places special tokens; don't add a BOS twice.
        return list(self._tok.encode(self.apply_chat_template(messages, tools), add_special_tokens=False))
