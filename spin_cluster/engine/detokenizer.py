"""A request's output text, grown one token at a time at a cost that does not grow with it.

Decoding the whole output again for every new token, and searching all of it for stop
strings, costs O(n) per token and O(n^2) per request. Here a token decodes a short window of
recent tokens, and the stop-string search covers the new text plus the few characters before
it in which a stop string could begin.
"""

from __future__ import annotations

from typing import Protocol

# What a window decodes to while its last character is still missing bytes.
INCOMPLETE = "\ufffd"


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


class Detokenizer:
    """One request's output text and the check for its stop strings.

    Two offsets into the output token ids; only the window from ``prefix`` on is decoded:

        token ids  [ ...in the text... | prefix ... | read ...  ]
                                        context      new tokens

        new text = decode(ids[prefix:]) past decode(ids[prefix:read])

    The context gives the new tokens the left neighbours their text can depend on (the
    leading space SentencePiece drops at the start of a decode, the first bytes of a
    character split over tokens). The window moves on once its text ends in a whole
    character, so a character is never split between two windows.
    """

    def __init__(self, decoder: Decoder, stop: tuple[str, ...] = ()) -> None:
        self._decoder = decoder
        self._stop = stop
        # A stop string ending in the new text begins at most this many characters before it.
        self.overlap = max(map(len, stop), default=1) - 1
        # The decoded output, cut before the first stop string once one is found.
        self.text = ""
        self._prefix = 0
        self._read = 0

    def add(self, token_ids: list[int], finishing: bool) -> bool:
        """Take in the output's newest tokens (``token_ids`` is the whole output so far).

        Returns True when the text now contains a stop string; it is then cut before it. Text
        that ends in an incomplete character waits for the next token, unless ``finishing``
        (no next token), when it is kept as it is.
        """
        new = self._new_text(token_ids)
        start = max(0, len(self.text) - self.overlap)
        tail = self.text[start:] + new
        at = self._first_stop(tail)
        if at is not None:
            self.text = self.text[:start] + tail[:at]
            return True
        if new and (finishing or not new.endswith(INCOMPLETE)):
            self.text += new
            self._prefix, self._read = self._read, len(token_ids)
        return False

    def visible_text(self, finished: bool) -> str:
        """The text a caller may see: while running, the last ``overlap`` characters are held
        back, since a stop string that begins in them would cut them off again."""
        if finished or not self.overlap:
            return self.text
        return self.text[: max(0, len(self.text) - self.overlap)]

    def _new_text(self, token_ids: list[int]) -> str:
        context = self._decoder.decode(token_ids[self._prefix : self._read])
        window = self._decoder.decode(token_ids[self._prefix :])
        # A window no longer than its context (a skipped special token) adds nothing yet.
        return window[len(context) :] if len(window) > len(context) else ""

    def _first_stop(self, text: str) -> int | None:
        hits = [i for i in (text.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
