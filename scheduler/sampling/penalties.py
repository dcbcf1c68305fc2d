"""What the repetition, frequency and presence penalties read, kept on the device from
step to step: per penalised request, the tokens it has seen and how often it has
generated each. Rebuilding it every step from the token lists would cost host work, a
copy and a dozen `[rows, vocab]` passes, comparable to a decode step at agent-length
contexts; and a checkpoint whose generation config sets a penalty (Qwen2-VL's,
Qwen2.5-VL's) gives one to every request.

Each running request that asks for a penalty holds one row, written once from its token
lists and then extended on the device by each sampled token:

- `seen_ids` `[rows, width]`: its distinct prompt tokens, then every output token. The
  repetition penalty gathers the logits there, rescales them and scatters them back, as
  transformers' `RepetitionPenaltyLogitsProcessor` does (a repeated id gets the same
  value twice). A row's unused columns repeat its first id.
- `first_output` `[rows, width]`: whether an output column holds its token's first
  occurrence among the outputs. The frequency and presence penalties add there
  `-(frequency × count + presence)` (the count from `output_counts` `[rows, vocab]`),
  and 0 elsewhere: sums that do not depend on the order a device adds them in.

A step's host work is O(penalised rows), its device work O(rows × seen tokens).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

INITIAL_ROWS = 8
INITIAL_WIDTH = 256


class PenaltyTable:
    """Rows held by requests (`acquire`) until `release`; a request without an id
    (`None`) holds a row for one call only (`release_unnamed`). The tables double when
    rows or columns run out and never shrink: they hold at most as many rows as requests
    have been penalised at once, as many columns as the most tokens one has seen."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.seen_ids = torch.zeros(0, INITIAL_WIDTH, dtype=torch.long, device=device)
        self.first_output = torch.zeros(0, INITIAL_WIDTH, dtype=torch.bool, device=device)
        self.output_counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self._num_seen: list[int] = []  # per row: the columns of seen_ids it uses
        self._num_prompt: list[int] = []  # per row: its distinct prompt tokens' columns
        self._row_of: dict[str, int] = {}
        self._unnamed: list[int] = []
        self._free: list[int] = []

    def __len__(self) -> int:
        """Rows held by requests."""
        return len(self._row_of)

    def acquire(
        self,
        request_ids: Sequence[str | None],
        prompts: Sequence[Sequence[int]],
        outputs: Sequence[Sequence[int]],
    ) -> list[int]:
        """Each request's row; a request seen for the first time gets a row filled from
        its prompt and output tokens (its one host-to-device copy)."""
        rows = []
        for request_id, prompt, output in zip(request_ids, prompts, outputs, strict=True):
            row = self._row_of.get(request_id) if request_id is not None else None
            if row is None:
                row = self._new_row(prompt, output)
                if request_id is None:
                    self._unnamed.append(row)
                else:
                    self._row_of[request_id] = row
            rows.append(row)
        return rows

    def num_seen(self, row: int) -> int:
        return self._num_seen[row]

    def seen(self, rows: Sequence[int]) -> torch.Tensor:
        """`[len(rows), columns]` token ids each row has seen (repeats pad the shorter;
        a row that has seen none would be padded with id 0: leave it out)."""
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.seen_ids[index, : max(self._num_seen[row] for row in rows)]

    def num_outputs(self, row: int) -> int:
        return self._num_seen[row] - self._num_prompt[row]

    def output_penalties(
        self, rows: Sequence[int], frequency: torch.Tensor, presence: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Token ids `[len(rows), columns]` of each row's outputs and what to add to their
        logits there: `-(frequency × count + presence)` at a token's first occurrence, 0
        at its others and at the padding (`frequency`, `presence`: `[len(rows), 1]`)."""
        width = max(self.num_outputs(row) for row in rows)
        starts = [self._num_prompt[row] for row in rows]
        index = torch.tensor(rows, dtype=torch.long, device=self.device).unsqueeze(1)
        offsets = torch.arange(width, device=self.device)
        columns = torch.tensor(starts, device=self.device).unsqueeze(1) + offsets
        valid = offsets < torch.tensor(
            [self.num_outputs(row) for row in rows], device=self.device
        ).unsqueeze(1)
        columns = columns.clamp(max=self.seen_ids.shape[1] - 1)
        ids = self.seen_ids[index, columns]
        first = self.first_output[index, columns] & valid
        counts = self.output_counts[index, ids]
        return ids, torch.where(first, -(frequency * counts + presence), 0.0)

    def record(self, rows: Sequence[int], tokens: torch.Tensor) -> None:
        """Adds each row's sampled token (`tokens` on the device: no host sync)."""
        if max(self._num_seen[row] for row in rows) >= self.seen_ids.shape[1]:
            self._widen()
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        columns = torch.tensor([self._num_seen[row] for row in rows], device=self.device)
        tokens = tokens.to(self.device)
        self.seen_ids[index, columns] = tokens
        self.first_output[index, columns] = self.output_counts[index, tokens] == 0
        ones = torch.ones(len(rows), dtype=self.output_counts.dtype, device=self.device)
        self.output_counts.index_put_((index, tokens), ones, accumulate=True)
        for row in rows:
            self._num_seen[row] += 1

    def release(self, request_id: str) -> None:
        row = self._row_of.pop(request_id, None)
        if row is not None:
            self._free.append(row)

    def release_unnamed(self) -> None:
        self._free.extend(self._unnamed)
        self._unnamed.clear()

    def _new_row(self, prompt: Sequence[int], output: Sequence[int]) -> int:
        if not self._free:
            self._grow()
        row = self._free.pop()
        seen = [*dict.fromkeys(prompt), *output]
        while len(seen) >= self.seen_ids.shape[1]:
            self._widen()
        ids = torch.tensor(seen or [0], dtype=torch.long).to(self.device)
        self.seen_ids[row, : len(ids)] = ids
        self.seen_ids[row, len(ids) :] = ids[0]
        num_prompt = len(seen) - len(output)
        first = _first_occurrences(output)
        self.first_output[row] = False
        self.first_output[row, num_prompt : len(seen)] = torch.tensor(first, dtype=torch.bool)
        self._num_seen[row] = len(seen)
        self._num_prompt[row] = num_prompt
        outputs = ids[num_prompt : len(seen)]
        counts = self.output_counts[row]
        counts.zero_().index_add_(0, outputs, torch.ones_like(outputs, dtype=counts.dtype))
        return row

    def _grow(self) -> None:
        old = self.seen_ids.shape[0]
        new = max(INITIAL_ROWS, 2 * old)
        width = self.seen_ids.shape[1]
        ids = torch.zeros(new, width, dtype=torch.long, device=self.device)
        first = torch.zeros(new, width, dtype=torch.bool, device=self.device)
        counts = torch.zeros(new, self.vocab, dtype=torch.float32, device=self.device)
        ids[:old] = self.seen_ids
        first[:old] = self.first_output
        counts[:old] = self.output_counts
        self.seen_ids, self.first_output, self.output_counts = ids, first, counts
        self._num_seen.extend([0] * (new - old))
        self._num_prompt.extend([0] * (new - old))
        self._free.extend(range(new - 1, old - 1, -1))  # pop() takes the lowest first

    def _widen(self) -> None:
        """Doubles the columns; the new ones repeat each row's first id."""
        ids = self.seen_ids
        self.seen_ids = torch.cat([ids, ids[:, :1].expand(-1, ids.shape[1])], dim=1)
        self.first_output = torch.cat(
            [self.first_output, torch.zeros_like(self.first_output)], dim=1
        )


def _first_occurrences(tokens: Sequence[int]) -> list[bool]:
    """For each token, whether it appears here for the first time."""
    earlier: set[int] = set()
    flags = []
    for token in tokens:
        flags.append(token not in earlier)
        earlier.add(token)
    return flags
