"""The latency budget, one part of prefill pacing (pacing.py): how many prefill tokens a
step may carry beside decodes, from measured step times.

A running stream's next token waits for the whole step it is in: `decode` seconds for a
step of decodes only, plus about `n × per_token` for a prefill chunk of `n` tokens beside
them. On a CPU prefill is compute-bound, so a long prompt joining in one step makes every
running stream wait for its whole prefill. Capping the prefill of a step with decodes at

    (stretch − 1) × decode ÷ per_token

tokens keeps each inter-token latency within about `stretch` × a decode step (the token
budget of Sarathi-Serve's stall-free batching, sized by measurement instead of offline
profiling). Steps without decodes are not capped: no stream waits on them.

Both costs are exponential moving averages of the steps' own times, kept per `key` (on
a CPU the steps' thread count, which changes while the encoder shares the cores). A key
without a decode-only step yet borrows another key's decode time (it varies little with
the thread count; the prefill cost does). Until a key's prefill cost is measured, a
step with decodes carries `min_tokens` of prefill; a prefill-only step measured before
any decode step counts its whole time against its tokens (an overestimate, so a smaller
cap, until decode steps refine it).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

SMOOTHING = 0.2  # weight of the newest step in the moving averages
_UNLIMITED = 1 << 30


@dataclass
class _Costs:
    decode_seconds: float | None = None  # a step with decodes and no prefill
    prefill_token_seconds: float | None = None  # added by each prefill token


class LatencyBudget:
    def __init__(self, stretch: float, min_tokens: int) -> None:
        """`stretch`: the longest a step with decodes may take, in decode steps (> 1);
        `min_tokens`: the smallest cap, so a prompt always moves on."""
        if stretch <= 1:
            raise ValueError(f"the stretch must be above 1, got {stretch}")
        self.stretch = stretch
        self.min_tokens = min_tokens
        self._costs: dict[Hashable, _Costs] = {}

    def cap(self, key: Hashable = None) -> int:
        """Prefill tokens the next step may carry if it has decodes."""
        costs = self._costs.get(key)
        decode = self._decode_seconds(key)
        if costs is None or costs.prefill_token_seconds is None or decode is None:
            return self.min_tokens
        if costs.prefill_token_seconds == 0:
            return _UNLIMITED  # prefill costs nothing measurable next to a decode step
        room = (self.stretch - 1) * decode
        fits = room / costs.prefill_token_seconds
        return max(self.min_tokens, int(fits + 1e-9))  # 19.999… tokens of binary rounding: 20

    def observe(
        self, num_decodes: int, num_prefill_tokens: int, seconds: float, key: Hashable = None
    ) -> None:
        """Accounts one step's time (`num_decodes` one-token chunks, the rest prefill)."""
        costs = self._costs.setdefault(key, _Costs())
        if num_prefill_tokens == 0:
            if num_decodes:
                costs.decode_seconds = _average(costs.decode_seconds, seconds)
            return
        if num_prefill_tokens < self.min_tokens:
            return  # too few tokens to tell their cost from the step's own
        decode = self._decode_seconds(key) or 0.0
        per_token = max(seconds - decode, 0.0) / num_prefill_tokens
        costs.prefill_token_seconds = _average(costs.prefill_token_seconds, per_token)

    def _decode_seconds(self, key: Hashable) -> float | None:
        costs = self._costs.get(key)
        if costs is not None and costs.decode_seconds is not None:
            return costs.decode_seconds
        known = [c.decode_seconds for c in self._costs.values() if c.decode_seconds is not None]
        return sum(known) / len(known) if known else None


def _average(mean: float | None, sample: float) -> float:
    return sample if mean is None else mean + SMOOTHING * (sample - mean)
