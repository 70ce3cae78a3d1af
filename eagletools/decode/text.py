"""The text of a growing token list, decoded a few tokens per step."""

from __future__ import annotations

from collections.abc import Sequence


class IncrementalText:
    """`decode(seq[first:n])` as `n` grows one token at a time; the tokens stay the caller's.

    Each token decodes a window from the start of the last complete piece (so
    a leading space or a clean-up sees its left context) and appends what the
    new tokens add; while the new tokens hold a partial multi-byte character
    the window keeps growing, so it always starts at a whole character. Where
    the window's text does not extend its context (a tokenizer whose clean-up
    looks further back), the whole text is decoded.
    """

    def __init__(self, tokenizer, first: int = 0):
        self.tokenizer = tokenizer
        self.first = self.n = first  # the text is of seq[first:n]
        self.text = ""
        self.done = ""  # text of seq[first:read]: final, whatever follows
        self.start = self.read = first  # the window: seq[start:n], context seq[start:read]
        self.context = ""

    def _decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def advance(self, seq: Sequence[int]) -> None:
        """Take in the next token, `seq[n]`."""
        self.n += 1
        window = self._decode(seq[self.start : self.n])
        if not window.startswith(self.context):
            self.text = self._decode(seq[self.first : self.n])
            return
        self.text = self.done + window[len(self.context) :]
        # a partial character decodes as U+FFFD (or as nothing, with errors="ignore")
        if len(window) > len(self.context) and not window.endswith("\ufffd"):
            self.start, self.read, self.done = self.read, self.n, self.text
            self.context = self._decode(seq[self.start : self.n])
