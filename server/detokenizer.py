"""Token ids to text, incrementally: never half a character, never past a stop string.

`IncrementalDetokenizer` keeps vLLM's two offsets into the ids: text is released up to
`read`, and each step re-decodes only `ids[prefix:]`, from where the last released text
began. While the decoded window ends in U+FFFD (byte-level BPE split a character over
several tokens) nothing is released and the window grows. The window stays a few tokens
long, so a step costs O(1) in the length of the output.

`TextStream` cuts stop strings exactly (the stop string and everything after it dropped)
and, while a stream runs, holds back a tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any

_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, *, skip_special_tokens: bool = True) -> None:
        backend = getattr(tokenizer, "backend_tokenizer", None)  # the Rust tokenizer: faster
        self._decode: Callable[[list[int]], str]
        if backend is not None:
            self._decode = partial(backend.decode, skip_special_tokens=skip_special_tokens)
        else:
            self._decode = partial(
                tokenizer.decode,
                skip_special_tokens=skip_special_tokens,
                clean_up_tokenization_spaces=False,
            )
        self.token_ids: list[int] = []
        self._prefix = 0  # start of the window re-decoded each step
        self._read = 0  # ids before this are released text

    def push(self, token_ids: Iterable[int]) -> str:
        """Adds ids; returns the text they complete (may be "" while a character is split)."""
        pieces = []
        for token in token_ids:  # one at a time: a split character holds back only itself
            self.token_ids.append(token)
            pieces.append(self._release(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Everything not released yet, an unfinished character included (as U+FFFD)."""
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self._read == len(self.token_ids):
            return ""
        released = self._decode(self.token_ids[self._prefix : self._read])
        window = self._decode(self.token_ids[self._prefix :])
        if len(window) <= len(released) or (window.endswith(_REPLACEMENT) and not final):
            return ""  # only special tokens, or a character still split
        self._prefix, self._read = self._read, len(self.token_ids)
        return window[len(released) :]


class TextStream:
    """One completion's text: feed each engine output to `update`; it returns the text that may
    be sent now. Once a stop string is found `stopped` is True and the text is final: the
    caller ends the response with finish_reason "stop" and aborts the request in the engine."""

    def __init__(
        self,
        tokenizer: Any,
        *,
        stop: Sequence[str] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens
        )
        self._stop = tuple(s for s in stop if s)
        self._pending = ""  # decoded, but maybe the start of a stop string
        self.text = ""  # everything returned so far
        self.stopped = False

    def update(self, token_ids: Sequence[int], *, finish_reason: str | None = None) -> str:
        """Text to send for these new ids; `finish_reason` set on the request's last output."""
        if self.stopped:
            return ""
        if finish_reason == "stop" and token_ids:
            # The engine stops only on an EOS or stop token id, never part of the text.
            token_ids = token_ids[:-1]
        new = self._detokenizer.push(token_ids)
        if finish_reason is not None:
            new += self._detokenizer.flush()
        buffer = self._pending + new
        cut = self._find_stop(buffer)
        if cut is not None:
            self.stopped = True
            release, self._pending = buffer[:cut], ""
        elif finish_reason is not None:
            release, self._pending = buffer, ""
        else:
            keep = self._stop_prefix_length(buffer)
            release, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.text += release
        return release

    def _find_stop(self, buffer: str) -> int | None:
        # A stop string cannot start in text already released: that text never ended in
        # a stop string's prefix (it would have been held back), so searching the
        # pending tail plus the new text is enough.
        hits = [i for i in (buffer.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _stop_prefix_length(self, buffer: str) -> int:
        """Length of the longest tail of `buffer` that some stop string starts with."""
        longest = min(len(buffer), max((len(s) - 1 for s in self._stop), default=0))
        for length in range(longest, 0, -1):
            tail = buffer[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0
