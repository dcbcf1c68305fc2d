"""Structured output: a grammar per constrained request, a token mask per step.

A request whose `Sampling.structured` is set gets a `GrammarMatcher` at admission (an
invalid grammar is refused there). Each step the sampler fills and applies one bitmask
row per constrained request only (`fill_bitmask`, `apply_bitmask`); after sampling, the
engine advances each matcher by its token. A complete grammar allows only EOS, so a
constrained request ends as any other, on EOS.

The engine is llguidance (`bench/results/grammar_engines.md`): a small wheel with no
dependencies where xgrammar requires torch and triton. Its tokenizer view of a
Qwen-sized vocabulary takes long to build, so it is built once, in a thread started with
the engine, and the first constrained request does not stall every running one.

JSON is generated compact (no free whitespace between tokens): a model with random
weights, or a confused one, cannot loop on whitespace until `max_tokens`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import llguidance
import llguidance.hf
import torch
from llguidance import LLMatcher

from ...common.grammars import grammar_error, grammar_of
from ...ipc.messages import StructuredOutput

logger = logging.getLogger(__name__)

BITS = 32  # tokens per bitmask word


class GrammarMatcher:
    """One request's place in its grammar."""

    def __init__(self, matcher: LLMatcher) -> None:
        self._matcher = matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into `bitmask[row]` (int32 words, bit i of word
        w: token 32w + i)."""
        array = bitmask[row].numpy()
        self._matcher.unsafe_compute_mask_ptr(array.ctypes.data, array.nbytes)

    def accept(self, token: int) -> bool:
        """Advances by `token`; False when the grammar does not allow it."""
        return bool(self._matcher.consume_token(token)) and not self._matcher.is_error()

    @property
    def error(self) -> str:
        return str(self._matcher.get_error())


class Grammars:
    """Compiles constraints into matchers over the model's vocabulary."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_token_ids: Iterable[int]):
        self.model_dir = Path(model_dir)
        self.vocab_size = vocab_size  # the LM head's width (may exceed the tokenizer's)
        self.eos_token_ids = sorted(eos_token_ids)
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._building = threading.Lock()

    def prepare_in_background(self) -> None:
        """Builds the tokenizer's grammar view in a daemon thread (a matcher waits for
        it if it comes first)."""
        threading.Thread(target=self._llg_tokenizer, name="grammar-view", daemon=True).start()

    def matcher(self, constraint: StructuredOutput) -> GrammarMatcher:
        """ValueError when the constraint does not compile."""
        error = grammar_error(constraint)
        if error is not None:
            raise ValueError(f"the {constraint.kind} constraint does not compile: {error}")
        matcher = LLMatcher(self._llg_tokenizer(), grammar_of(constraint), log_level=0)
        if matcher.is_error():
            raise ValueError(f"the {constraint.kind} constraint: {matcher.get_error()}")
        return GrammarMatcher(matcher)

    def _llg_tokenizer(self) -> Any:
        with self._building:
            if self._tokenizer is None:
                self._tokenizer = self._build_view()
        return self._tokenizer

    def _build_view(self) -> Any:
        from transformers import AutoTokenizer

        start = time.perf_counter()
        hf = AutoTokenizer.from_pretrained(self.model_dir)
        view = llguidance.hf.from_tokenizer(
            hf,  # type: ignore[arg-type]  # a fast tokenizer (llguidance needs one)
            n_vocab=self.vocab_size,
            eos_token=self.eos_token_ids,
        )
        logger.info(
            "structured output: the tokenizer's grammar view took %.2f s (once)",
            time.perf_counter() - start,
        )
        return view


def new_bitmask(rows: int, vocab_size: int) -> torch.Tensor:
    """An all-disallowed `[rows, ceil(vocab / 32)]` int32 bitmask on the host."""
    return torch.zeros(rows, (vocab_size + BITS - 1) // BITS, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, rows: list[int], bitmask: torch.Tensor) -> None:
    """Sets the disallowed tokens of `logits[rows]` to -inf, in place (`bitmask[i]` for
    `rows[i]`). The bits are unpacked on the logits' device: one small copy."""
    vocab = logits.shape[-1]
    words = bitmask.to(logits.device, non_blocking=True)
    shifts = torch.arange(BITS, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().flatten(1)[:, :vocab]
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
