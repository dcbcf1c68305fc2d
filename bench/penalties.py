"""What a penalty costs the sampler per decode step: the penalty state kept across steps
(`scheduler/penalties.py`) against the same state rebuilt from the token lists at every
step (what the sampler did before it was kept), and against no penalty at all.

Rows of random logits over Qwen2-VL's vocabulary (151,936), each with a prompt of
`--context` random token ids, sampled greedily for `--steps` steps (each step's token
appended to its row's output). Variants, in one run:

- none: no penalty (the argmax alone);
- repetition, kept: repetition_penalty 1.05 (Qwen2-VL's and Qwen2.5-VL's
  generation_config.json, so every request of a real checkpoint), state kept;
- repetition, rebuilt: the same, each step's rows without a request id, so the state is
  built from the prompt and output lists at every step;
- frequency + presence, kept: OpenAI's penalties (0.5 each), over each row's outputs.

    python -m bench.penalties [--batches 8 32] [--context 4000] [--steps 16] [--quick]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.results_io import markdown_table, write_result
from iris_serve.ipc.messages import Sampling
from iris_serve.scheduler.sampling import Sampler, SamplingRow

VOCAB = 151_936
VARIANTS = {
    "none": (Sampling(temperature=0.0), True),
    "repetition, kept": (Sampling(temperature=0.0, repetition_penalty=1.05), True),
    "repetition, rebuilt": (Sampling(temperature=0.0, repetition_penalty=1.05), False),
    "frequency + presence, kept": (
        Sampling(temperature=0.0, frequency_penalty=0.5, presence_penalty=0.5),
        True,
    ),
}


def ms_per_step(
    params: Sampling, keep: bool, batch: int, context: int, steps: int, vocab: int
) -> float:
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(vocab, (context,), generator=generator).tolist() for _ in range(batch)]
    outputs: list[list[int]] = [[] for _ in range(batch)]
    logits = torch.randn(batch, vocab, generator=generator)
    sampler = Sampler()
    elapsed = 0.0
    for _ in range(steps):
        rows = [
            SamplingRow(params, None, (), prompt, output, request_id=str(i) if keep else None)
            for i, (prompt, output) in enumerate(zip(prompts, outputs, strict=True))
        ]
        step_logits = logits.clone()
        started = time.perf_counter()
        tokens = sampler(step_logits, rows).tolist()
        elapsed += time.perf_counter() - started
        for output, token in zip(outputs, tokens, strict=True):
            output.append(token)
    return elapsed / steps * 1e3


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--context", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--threads", type=int, default=2, help="torch threads")
    parser.add_argument("--quick", action="store_true", help="tiny shapes (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    vocab = VOCAB
    if args.quick:
        args.batches, args.context, args.steps, vocab = [2], 50, 2, 1000
    torch.set_num_threads(args.threads)
    rows = []
    for batch in args.batches:
        ms = {
            name: ms_per_step(params, keep, batch, args.context, args.steps, vocab)
            for name, (params, keep) in VARIANTS.items()
        }
        rows.append(
            [f"{batch} × {args.context}", *ms.values(),
             ms["repetition, rebuilt"] / ms["repetition, kept"]]
        )  # fmt: skip
    body = (
        f"Sampler ms per step (the mean of {args.steps}), vocabulary {vocab}, "
        f"{args.threads} torch threads, greedy rows, each penalised variant on every row.\n\n"
        + markdown_table(
            ["rows × prompt tokens", *(f"{name} ms" for name in VARIANTS), "rebuilt ÷ kept"],
            rows,
        )
    )
    suffix = "_quick" if args.quick else ""
    write_result(f"penalties{suffix}", "The sampler's penalties per decode step", body, args.out)


if __name__ == "__main__":
    main()
