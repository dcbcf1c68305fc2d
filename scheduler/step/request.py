"""A request as the scheduler sees it: token ids, image spans, sampling, outputs, status.

Its KV state is its `PageTable` (page_table.py); everything else it holds in the
scheduler has one owner that lets go of it (`RequestResources`; `docs/design.md`, "Each
per-request resource has one owner that releases it").
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from ...ipc.messages import FinishReason, ImageRef, ImageReport, Sampling
from ..kv.page_table import PageTable
from ..sampling.structured_output import GrammarMatcher


class RequestResources:
    """An owner of per-request state in the scheduler, listed once in `Engine._owners`:
    `release` when a request ends, however it ends, and `preempt` when the planner preempts
    it (it is recomputed later from its tokens)."""

    def preempt(self, request: Request) -> None:
        """The request was preempted: let go of what its recompute does not need kept
        (by default, nothing)."""

    def rewind(self, request: Request, num_computed_tokens: int) -> None:
        """The step that was to compute the request's tokens from `num_computed_tokens` on
        raised: forget what that step was to produce (by default, nothing)."""

    def release(self, request: Request) -> None:
        """The request ended: let go of everything held for it; safe to call twice."""
        raise NotImplementedError


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """The scheduler's record of one request. The engine creates it (generator and
    grammar included) and writes its outputs and finish reason; the planner its status,
    preemption count, prefix-cache hit and queue time."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: Sampling
    images: list[ImageRef] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    # one per image of a served chat request (none in process): the client's report, as
    # the tokenizer worker filled it in (`Engine` adds the scheduler's cache levels)
    image_reports: list[ImageReport] = field(default_factory=list)

    # M-RoPE: prompt positions [3, prompt_len]; token i >= prompt_len sits at i + rope_delta.
    prompt_positions: torch.Tensor | None = None
    rope_delta: int = 0

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None  # "stop": EOS or a stop id; "length"; "abort"
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    grammar: GrammarMatcher | None = None  # structured output: where the output is in it

    num_cached_tokens: int = 0  # found in the prefix cache at the first admission (usage)
    num_host_cached_tokens: int = 0  # of those, reloaded from the host tier
    added_at: float = field(default_factory=time.monotonic)  # when the engine took it
    queue_seconds: float | None = None  # from `added_at` to its first step
    first_step_at: float | None = None  # `time.monotonic()` of its first admission
    prefill_step_seconds: float = 0.0  # wall time of the steps that computed its prompt
    page_table: PageTable = field(default_factory=PageTable)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        prompt_len = self.prompt_len
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def positions(self, start: int, end: int) -> torch.Tensor:
        """M-RoPE positions `[3, end - start]` of tokens `start..end`."""
        assert self.prompt_positions is not None, "positions are set when the request is added"
        prompt_len = self.prompt_len
        parts = []
        if start < prompt_len:
            parts.append(self.prompt_positions[:, start : min(end, prompt_len)])
        if end > prompt_len:
            first = max(start, prompt_len)
            generated = torch.arange(first, end, dtype=torch.long) + self.rope_delta
            parts.append(generated.unsqueeze(0).expand(3, -1))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)

    def suppressed_token_ids(self) -> list[int]:
        """Tokens that may not be sampled next: stop tokens before `min_tokens` is reached."""
        if len(self.output_token_ids) >= self.sampling.min_tokens:
            return []
        stops = set(self.sampling.stop_token_ids)
        if not self.sampling.ignore_eos:
            stops |= self.eos_token_ids
        return sorted(stops)
