"""The check on sampling parameters (the wire `Sampling`, run as it is) and the batched sampler.

Every request in a step is sampled in one pass over a `[batch, vocab]` logits tensor, in
vLLM's order: the grammar mask of the rows with structured output, logit bias, min_tokens
suppression, repetition penalty (prompt and output tokens, as transformers'), frequency
and presence penalties (output tokens, OpenAI's definition; their state stays on the
device, `penalties.py`); then greedy rows take the argmax and the others go through
temperature, top-k, top-p and min-p masks and an exponential-race draw (`argmax(p / q)`
with `q ~ Exp(1)` is a sample from `p`). The race lets a request with a `seed` draw its
noise from its own generator, so its tokens do not depend on the rest of the batch.

At the edges of the parameters the draw is still a sample of the masked distribution,
never a NaN's token: a temperature below `GREEDY_BELOW` is greedy (as vLLM's), as is a
top-p or min-p that would keep nothing (the most likely token always stays); a logit that
overflowed (a huge penalty, a tiny temperature) is clamped to float32's largest, so it
wins without turning the softmax into NaNs; and a token the masks removed cannot win the
race even where its noise draws zero.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from ...ipc.messages import Sampling, TokenLogprob
from .penalties import PenaltyTable
from .structured_output import GrammarMatcher, apply_bitmask, new_bitmask

GREEDY_BELOW = 1e-5  # a smaller temperature samples greedily (vLLM's _SAMPLING_EPS)
_LARGEST = torch.finfo(torch.float32).max
_TINIEST = torch.finfo(torch.float32).tiny


def is_greedy(params: Sampling) -> bool:
    """Whether the request takes the argmax: temperature 0, or one so small that dividing
    the logits by it would overflow float32."""
    return params.temperature < GREEDY_BELOW


def check_sampling(params: Sampling) -> None:
    """Raises ValueError for parameters the sampler cannot honour: the check the engine applies
    to what it runs (the wire type has none; `max_tokens=0` from the server means "as many as
    the context allows" until the scheduler fills it in at admission)."""
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if params.temperature < 0:
        raise ValueError(f"temperature must be non-negative, got {params.temperature}")
    if not 0 < params.top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {params.top_p}")
    if params.top_k < -1:
        raise ValueError(f"top_k must be -1, 0 or positive, got {params.top_k}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(
            f"min_tokens must be in [0, max_tokens={params.max_tokens}], got {params.min_tokens}"
        )
    if params.repetition_penalty <= 0:
        raise ValueError(f"repetition_penalty must be positive, got {params.repetition_penalty}")
    if not 0 <= params.min_p <= 1:
        raise ValueError(f"min_p must be in [0, 1], got {params.min_p}")
    if params.logprobs is not None and params.logprobs < 0:
        raise ValueError(f"logprobs must be non-negative, got {params.logprobs}")


class SamplingFieldError(ValueError):
    """A sampling option the engine cannot honour, naming it (`param`, as the API does)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def check_token_ids(params: Sampling, vocab_size: int) -> None:
    """Raises `SamplingFieldError` for a stop or biased token outside the vocabulary: the
    sampler indexes the logits by them."""
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", [token for token, _ in params.logit_bias])):  # fmt: skip
        bad = [token for token in ids if not 0 <= token < vocab_size]
        if bad:
            raise SamplingFieldError(
                f"{name}: token id {bad[0]} is out of the vocabulary [0, {vocab_size})", name
            )


@dataclass
class SamplingRow:
    """One request's view for one step: its parameters and what the sampler must know."""

    params: Sampling
    generator: torch.Generator | None
    suppress_token_ids: Sequence[int]  # e.g. EOS while fewer than min_tokens were generated
    prompt_token_ids: Sequence[int] = ()  # read only by the repetition penalty
    output_token_ids: Sequence[int] = ()  # read only by the penalties
    grammar: GrammarMatcher | None = None  # structured output: masks what would break it
    # whose row this is: a penalised request keeps its penalty state under it from step
    # to step (`Sampler.release` when it ends); None: this call alone (tests)
    request_id: str | None = None

    @property
    def penalized(self) -> bool:
        p = self.params
        return bool(p.frequency_penalty or p.presence_penalty or p.repetition_penalty != 1.0)


class Sampler:
    """Samples one token per row of a logits batch; no Python loop over the vocabulary.
    Holds the penalised requests' state (`PenaltyTable`) between calls."""

    def __init__(self) -> None:
        self.penalties: PenaltyTable | None = None

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        logits = logits.float()
        self._apply_grammars(logits, rows)
        self._add_bias(logits, rows)
        self._suppress(logits, rows)
        penalized = self._penalize(logits, rows)
        tokens = self._choose(logits, rows)
        if penalized is not None and self.penalties is not None:
            logit_rows, table_rows = penalized
            self.penalties.record(table_rows, tokens[logit_rows])
            self.penalties.release_unnamed()
        return tokens

    def release(self, request_id: str) -> None:
        """Drops what the sampler keeps for a request that has ended."""
        if self.penalties is not None:
            self.penalties.release(request_id)

    def _choose(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        device = logits.device
        greedy_tokens = logits.argmax(dim=-1)
        greedy = [is_greedy(row.params) for row in rows]
        if all(greedy):
            return greedy_tokens

        # A greedy row's temperature is unused; one past float32's range samples uniformly.
        temperatures = [
            1.0 if g else min(r.params.temperature, _LARGEST)
            for g, r in zip(greedy, rows, strict=True)
        ]
        temperature = torch.tensor(temperatures, device=device).unsqueeze(1)
        logits = (logits / temperature).nan_to_num_(nan=float("-inf"), posinf=_LARGEST)
        logits = self._apply_top_k(logits, rows)
        logits = self._apply_top_p(logits, rows)
        probs = self._apply_min_p(torch.softmax(logits, dim=-1), rows)

        noise = torch.empty_like(probs)
        unseeded = [i for i, row in enumerate(rows) if row.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i] = torch.empty(vocab, device=device).exponential_(generator=row.generator)
        # Exp(1) can draw 0: with a masked token's zero probability, 0 / 0 would win.
        sampled_tokens = (probs / noise.clamp_min_(_TINIEST)).argmax(dim=-1)
        return torch.where(torch.tensor(greedy, device=device), greedy_tokens, sampled_tokens)

    @staticmethod
    def _apply_grammars(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        constrained = [i for i, row in enumerate(rows) if row.grammar is not None]
        if not constrained:
            return
        bitmask = new_bitmask(len(constrained), logits.shape[-1])
        for k, i in enumerate(constrained):
            grammar = rows[i].grammar
            assert grammar is not None
            grammar.fill_bitmask(bitmask, k)
        apply_bitmask(logits, constrained, bitmask)

    @staticmethod
    def _add_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        pairs = [
            (i, token, bias) for i, r in enumerate(rows) for token, bias in r.params.logit_bias
        ]
        if pairs:
            row_index, token_index, bias = zip(*pairs, strict=True)
            logits[list(row_index), list(token_index)] += torch.tensor(bias, device=logits.device)

    def _penalize(
        self, logits: torch.Tensor, rows: Sequence[SamplingRow]
    ) -> tuple[list[int], list[int]] | None:
        """The penalties of the rows that ask for one, from each request's row of the
        penalty table (`penalties.py`). Returns the penalised rows of `logits` and their
        rows of the table, or None."""
        penalized = [i for i, row in enumerate(rows) if row.penalized]
        if not penalized:
            return None
        device = logits.device
        if self.penalties is None:
            self.penalties = PenaltyTable(logits.shape[-1], device)
        table = self.penalties
        chosen = [rows[i] for i in penalized]
        table_rows = table.acquire(
            [row.request_id for row in chosen],
            [row.prompt_token_ids for row in chosen],
            [row.output_token_ids for row in chosen],
        )

        def column(values: list[float]) -> torch.Tensor:
            return torch.tensor(values, device=device).unsqueeze(1)

        repeating = [
            k
            for k, row in enumerate(chosen)
            if row.params.repetition_penalty != 1.0 and table.num_seen(table_rows[k])
        ]
        if repeating:  # as transformers: seen tokens' logits divided if > 0, else multiplied
            at = torch.tensor([penalized[k] for k in repeating], device=device).unsqueeze(1)
            ids = table.seen([table_rows[k] for k in repeating])
            penalty = column([chosen[k].params.repetition_penalty for k in repeating])
            score = logits[at, ids]
            logits[at, ids] = torch.where(score > 0, score / penalty, score * penalty)
        counted = [  # OpenAI's penalties: output tokens only
            k
            for k, row in enumerate(chosen)
            if (row.params.frequency_penalty or row.params.presence_penalty)
            and table.num_outputs(table_rows[k])
        ]
        if counted:
            at = torch.tensor([penalized[k] for k in counted], device=device).unsqueeze(1)
            ids, added = table.output_penalties(
                [table_rows[k] for k in counted],
                column([chosen[k].params.frequency_penalty for k in counted]),
                column([chosen[k].params.presence_penalty for k in counted]),
            )
            logits.index_put_((at.expand_as(ids), ids), added, accumulate=True)
        return penalized, table_rows

    @staticmethod
    def _apply_min_p(probs: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        """Zeroes the tokens below `min_p` times the row's most likely token's probability
        (a zero can never win the race below)."""
        if all(row.params.min_p <= 0 for row in rows):
            return probs
        min_p = torch.tensor([row.params.min_p for row in rows], device=probs.device)
        floor = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        return probs.masked_fill(probs < floor, 0.0)  # the most likely token is never below

    @staticmethod
    def _suppress(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
        """min_tokens: EOS and stop ids are masked, except under a grammar, which alone
        decides when its output may end (masking EOS there could leave nothing)."""
        row_index: list[int] = []
        token_index: list[int] = []
        for i, row in enumerate(rows):
            if row.grammar is not None:
                continue
            row_index.extend([i] * len(row.suppress_token_ids))
            token_index.extend(row.suppress_token_ids)
        if row_index:
            logits[row_index, token_index] = float("-inf")

    @staticmethod
    def _apply_top_k(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        vocab = logits.shape[-1]
        ks = [row.params.top_k if row.params.top_k > 0 else vocab for row in rows]
        if all(k >= vocab for k in ks):
            return logits
        k = torch.tensor(ks, device=logits.device).clamp(max=vocab).unsqueeze(1)
        sorted_logits = logits.sort(dim=-1, descending=True).values
        kth_largest = sorted_logits.gather(-1, k - 1)
        return logits.masked_fill(logits < kth_largest, float("-inf"))

    @staticmethod
    def _apply_top_p(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
        if all(row.params.top_p >= 1.0 for row in rows):
            return logits
        top_p = torch.tensor([row.params.top_p for row in rows], device=logits.device)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p; the top token always stays,
        # even where top_p rounds to 0 in float32.
        drop_sorted = mass_before >= top_p.unsqueeze(1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        return logits.masked_fill(drop, float("-inf"))


def token_logprobs(
    logits: torch.Tensor, wanted: Sequence[int | None]
) -> Callable[[torch.Tensor], list[TokenLogprob | None]] | None:
    """Log-softmax of the rows whose request wants logprobs (`wanted[i]`: how many top tokens,
    None: none), taken before sampling changes `logits`; returns the function that reads
    each row's sampled token and top-N in one host transfer (None when no row wants any)."""
    rows = [i for i, n in enumerate(wanted) if n is not None]
    if not rows:
        return None
    logprobs = torch.log_softmax(logits[rows].float(), dim=-1)
    k = min(max(wanted[i] or 0 for i in rows), logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k else None

    def read(tokens: torch.Tensor) -> list[TokenLogprob | None]:
        index = torch.tensor(rows, device=tokens.device)
        chosen = logprobs.gather(1, tokens[index].unsqueeze(1)).squeeze(1)
        host = chosen.tolist(), tokens[index].tolist()
        top_ids, top_values = (top.indices.tolist(), top.values.tolist()) if top else ([], [])
        out: list[TokenLogprob | None] = [None] * len(wanted)
        for j, i in enumerate(rows):
            n = wanted[i] or 0
            pairs = tuple(zip(top_ids[j][:n], top_values[j][:n], strict=True)) if n else ()
            out[i] = TokenLogprob(host[1][j], host[0][j], pairs)
        return out

    return read
