"""When generation stops (EOS, max tokens, stop strings), and its text streamed
as it becomes final."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from eagletools.decode.text import IncrementalText

END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>")


def eos_token_ids(tokenizer) -> set[int]:
    """The tokenizer's EOS plus the end-of-turn tokens chat templates close replies with."""
    vocab = tokenizer.get_vocab()
    ids = {vocab[name] for name in END_OF_TURN if name in vocab}
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class Stopper:
    """Checks the new tokens of a sequence for a stop and streams their text.

    The tokens stay the caller's (`check(seq, kept)`); the stopper keeps only
    the text, and searches for stop strings only where the new tokens could
    have completed one.
    """

    def __init__(
        self,
        tokenizer,
        eos: set[int],
        max_new_tokens: int,
        stop_strings: Sequence[str] = (),
        on_text: Callable[[str], None] | None = None,
        first: int = 0,
    ):
        self.max_new_tokens = max_new_tokens
        self.stop_strings = [s for s in stop_strings if s]
        if self.stop_strings and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.longest = max(map(len, self.stop_strings), default=0)
        self.eos = eos
        self.on_text = on_text
        self.first = first  # the new tokens are seq[first:]
        self.decoded = IncrementalText(tokenizer, first) if tokenizer is not None else None
        self.text = ""  # the reply's text so far (final once stopped)
        self.streamed = 0  # characters of `text` given to on_text

    def check(self, seq: Sequence[int], kept: int) -> tuple[int, str]:
        """`seq` grew after its first `kept` new tokens: (new tokens kept, the stop reason
        or ""). At a stop the tokens after it are not kept (a stop string: its text cut)."""
        reason = ""
        while not reason and self.first + kept < len(seq):
            tok = seq[self.first + kept]
            kept += 1
            if self.decoded is not None:
                final_before = len(self.decoded.done)
                self.decoded.advance(seq)
            if tok in self.eos:
                reason = "eos"
            elif kept >= self.max_new_tokens:
                reason = "max_tokens"
            elif self.stop_strings:
                tail = self.decoded.text[max(0, final_before - self.longest + 1) :]
                if any(s in tail for s in self.stop_strings):
                    reason = "stop_string"
        self.emit(reason)
        return kept, reason

    def emit(self, reason: str = "") -> None:
        """Stream the text that is final: all of it once stopped for `reason`."""
        if self.decoded is None:
            return
        text = self.decoded.text
        if reason == "stop_string":
            text = text[: min(text.find(s) for s in self.stop_strings if s in text)]
        self.text = text
        if not reason:
            text = text.rstrip("\ufffd")  # a multi-byte character still incomplete
            if self.stop_strings:  # hold back what could begin a stop string
                text = text[: len(text) - self.longest + 1]
        if (
            self.on_text
            and len(text) > self.streamed
            and text.startswith(self.text[: self.streamed])
        ):
            self.on_text(text[self.streamed :])
            self.streamed = len(text)
