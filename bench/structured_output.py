"""What structured output costs a mixed batch, in process, per decode step.

    python -m bench.structured_output [--size small] [--arch ARCH] [--threads N] [--quick]
    python -m bench.structured_output --like Qwen2-VL-2B-Instruct [--num-layers 1] ...

`--like NAME` runs on a random checkpoint with NAME's widths cut to `--num-layers` text
layers (generated once into the checkpoint cache, ~1.3 GB for Qwen2-VL-2B): the mask then
has the real vocabulary's width (151936), where the generated `tiny` / `small` have 1536.
`--rounds` / `--steps` shorten a run on a slow checkpoint.

One `Engine` on the generated checkpoint runs batches of 8 requests side by side, greedy,
the same 8 prompts of 128 tokens each time, every request decoding to the same length
(free ones with `ignore_eos`; constrained ones under grammars whose answers are longer
than the window, checked: each must end on `length`), so the batch is fixed from the
first decode step to the last:

- (a) 8 free requests;
- (b) 4 free + 4 json_schema (an array of 64 strings of 6 characters);
- (c) 8 json_schema;
- (d) 4 free + 4 regex (`[a-z ]{1000}`).

The first decode steps of each batch are warm-up (llguidance grows a matcher's lexer
during its first masks) and the last one is left out (it frees the batch); the steps
between are timed. The variants take turns, round after round, starting each round one
variant further, so a drift of the machine's load hits them alike.

Timers wrap `ModelRunner.forward`, `Sampler._apply_grammars` (a bitmask row filled per
constrained request, then applied to the logits) and, inside it,
`GrammarMatcher.fill_bitmask`, and `GrammarMatcher.accept` (the engine advancing each
matcher by its token), so a step splits into the forward, llguidance's mask fill, torch's
mask apply, the matchers' advance and the rest. Before the batches, the one-offs: the first constrained
request's matcher (it builds llguidance's view of the tokenizer, once per engine) and the
per-request compile of each kind (median of repeats), with the first mask after it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.results_io import (
    ARCH_TITLES,
    add_arch_argument,
    add_common_arguments,
    checkpoint_label,
    markdown_table,
    write_result,
)
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling, StructuredOutput
from iris_serve.scheduler.sampling import Sampler
from iris_serve.scheduler.structured_output import GrammarMatcher, new_bitmask

BATCH = 8
PROMPT_LEN = 128
# Answers longer than a batch's window (106 tokens by default; `run_batch` checks it),
# whichever tokens greedy picks: ~330 tokens for the schema, ~250 for the regex.
SCHEMA = {
    "type": "array",
    "items": {"type": "string", "minLength": 6, "maxLength": 6},
    "minItems": 64,
    "maxItems": 64,
}
REGEX = "[a-z ]{1000}"
CONSTRAINTS = {
    "json_schema": StructuredOutput("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredOutput("regex", REGEX),
}
# Compiled for the one-off table only, beside the two above.
COMPILE_ONLY = {
    "json_object": StructuredOutput("json_object"),
    "choice": StructuredOutput("choice", json.dumps(["yes", "no", "maybe"])),
}


@dataclass(frozen=True)
class Variant:
    key: str
    free: int
    constrained: int
    kind: str | None = None

    @property
    def name(self) -> str:
        parts = [f"{self.free} free"] if self.free else []
        if self.constrained:
            parts.append(f"{self.constrained} {self.kind}")
        return f"({self.key}) " + " + ".join(parts)


VARIANTS = (
    Variant("a", BATCH, 0),
    Variant("b", BATCH // 2, BATCH // 2, "json_schema"),
    Variant("c", 0, BATCH, "json_schema"),
    Variant("d", BATCH // 2, BATCH // 2, "regex"),
)


@dataclass
class Setting:
    warmup: int  # decode steps of each batch left out at its start
    measured: int  # decode steps timed per batch
    rounds: int  # batches per variant
    compiles: int  # repeats per constraint kind in the one-off table


FULL = Setting(warmup=8, measured=96, rounds=5, compiles=20)
QUICK = Setting(warmup=2, measured=6, rounds=1, compiles=3)


@dataclass
class Step:
    seconds: float
    forward: float  # ModelRunner.forward: the model, up to the logits
    mask: float  # Sampler._apply_grammars: fill + apply
    fill: float  # GrammarMatcher.fill_bitmask, summed over the constrained rows
    accept: float  # GrammarMatcher.accept, summed over the constrained rows


@dataclass
class Measured:
    steps: list[Step] = field(default_factory=list)  # the timed steps, all rounds
    warmup: list[Step] = field(default_factory=list)  # the warm-up steps, all rounds


class StepTimers:
    """Accumulates the wall time of the wrapped calls until `take`: the model's forward,
    and the grammar's mask (fill + apply), fill and accept."""

    SLOTS = ("forward", "mask", "fill", "accept")

    def __init__(self) -> None:
        self.seconds = dict.fromkeys(self.SLOTS, 0.0)

    def take(self) -> list[float]:
        values = [self.seconds[slot] for slot in self.SLOTS]
        self.seconds = dict.fromkeys(self.SLOTS, 0.0)
        return values

    @contextmanager
    def installed(self) -> Iterator[StepTimers]:
        """Wraps the four calls on their classes for the `with` block."""
        from iris_serve.scheduler.model_runner import ModelRunner

        originals = [
            (ModelRunner, "forward", ModelRunner.forward, "forward"),
            (Sampler, "_apply_grammars", Sampler.__dict__["_apply_grammars"], "mask"),
            (GrammarMatcher, "fill_bitmask", GrammarMatcher.fill_bitmask, "fill"),
            (GrammarMatcher, "accept", GrammarMatcher.accept, "accept"),
        ]

        def timed(call: Callable[..., Any], slot: str) -> Callable[..., Any]:
            def wrapper(*args: Any) -> Any:
                started = time.perf_counter()
                try:
                    return call(*args)
                finally:
                    self.seconds[slot] += time.perf_counter() - started

            return wrapper

        for owner, name, original, slot in originals:
            if isinstance(original, staticmethod):
                setattr(owner, name, staticmethod(timed(original.__func__, slot)))
            else:
                setattr(owner, name, timed(original, slot))
        try:
            yield self
        finally:
            for owner, name, original, _ in originals:
                setattr(owner, name, original)


def prompts() -> list[PromptInput]:
    """The same 8 prompts for every batch: distinct ids of the generated vocabulary (all
    below its special tokens), no shared prefix."""
    return [
        PromptInput.text([100 + (slot * 131 + i * 7) % 1300 for i in range(PROMPT_LEN)])
        for slot in range(BATCH)
    ]


def run_batch(
    engine: Any, variant: Variant, number: int, setting: Setting, timers: StepTimers
) -> Measured:
    """One batch of `variant` from admission to its end; its warm-up and timed steps."""
    # step 0 prefills (token 1), decode step k samples token k + 1; the last step, which
    # finishes every request at once, is not timed
    max_tokens = setting.warmup + setting.measured + 2
    free = Sampling(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    ids = [f"{variant.key}-{number}-{slot}" for slot in range(BATCH)]
    for slot, (request_id, prompt) in enumerate(zip(ids, prompts(), strict=True)):
        if slot < variant.free:
            sampling = free
        else:
            assert variant.kind is not None
            sampling = Sampling(
                temperature=0.0, max_tokens=max_tokens, structured=CONSTRAINTS[variant.kind]
            )
        engine.add_request(request_id, prompt, sampling)
    tokens = dict.fromkeys(ids, 0)
    reasons: dict[str, str | None] = {}
    measured = Measured()
    decode_step = 0
    while engine.has_unfinished_requests():
        timers.take()
        started = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - started
        step = Step(seconds, *timers.take())
        for output in outputs:
            tokens[output.request_id] += len(output.new_token_ids)
            if output.finished:
                reasons[output.request_id] = output.finish_reason
        if decode_step == 0 and not all(tokens.values()):
            continue  # a prefill step (one, with the default budget)
        if 1 <= decode_step <= setting.warmup:
            measured.warmup.append(step)
        elif setting.warmup < decode_step <= setting.warmup + setting.measured:
            measured.steps.append(step)
        decode_step += 1
    if failed := engine.pop_failed():
        raise RuntimeError(f"{variant.name}: {failed[0].message}")
    short = {i: (tokens[i], reasons.get(i)) for i in ids if tokens[i] != max_tokens}
    if short or set(reasons.values()) != {"length"} or len(measured.steps) != setting.measured:
        raise RuntimeError(
            f"{variant.name}: the batch did not stay whole through the window: requests "
            f"(tokens, reason) {short or reasons}; {len(measured.steps)} timed steps"
        )
    return measured


def one_offs(engine: Any, setting: Setting) -> list[list[object]]:
    """The first constrained request's matcher (tokenizer view + compile), then the
    per-request compile and first mask of each kind: the one-off table's rows."""
    vocab = engine.grammars.vocab_size
    started = time.perf_counter()
    engine.grammars.matcher(CONSTRAINTS["json_schema"])
    first = time.perf_counter() - started
    rows: list[list[object]] = [
        ["first constrained request (json_schema): tokenizer view + compile", 1, 1e3 * first,
         "-", "-"],
    ]  # fmt: skip
    for kind, constraint in {**CONSTRAINTS, **COMPILE_ONLY}.items():
        compiles, masks = [], []
        for _ in range(setting.compiles):
            started = time.perf_counter()
            matcher = engine.grammars.matcher(constraint)
            compiled = time.perf_counter()
            matcher.fill_bitmask(new_bitmask(1, vocab), 0)
            compiles.append(compiled - started)
            masks.append(time.perf_counter() - compiled)
        rows.append([
            f"compile per request: {kind}", setting.compiles,
            1e3 * statistics.median(compiles), 1e3 * max(compiles),
            1e3 * statistics.median(masks),
        ])  # fmt: skip
    return rows


def _ms(values: list[float]) -> tuple[float, float, float]:
    ms = 1e3 * np.asarray(values)
    return float(ms.mean()), float(np.percentile(ms, 50)), float(np.percentile(ms, 90))


def _mean_ms(steps: list[Step], part: Callable[[Step], float]) -> float:
    return 1e3 * statistics.fmean(part(s) for s in steps)


def step_rows(results: dict[Variant, Measured]) -> list[list[object]]:
    """Per variant: step ms, tok/s (all, free only) and the step time against (a)'s."""
    base = results[VARIANTS[0]].steps
    base_mean, base_p50, _ = _ms([s.seconds for s in base])
    rows: list[list[object]] = []
    for variant, measured in results.items():
        seconds = [s.seconds for s in measured.steps]
        mean, p50, p90 = _ms(seconds)
        total = sum(seconds)
        free = variant.free * len(seconds) / total if variant.free else "-"
        rows.append([
            variant.name, len(seconds), mean, p50, p90, BATCH * len(seconds) / total, free,
            f"{p50 / base_p50:.3f}", f"{mean / base_mean:.3f}",
        ])  # fmt: skip
    return rows


def verdict(results: dict[Variant, Measured]) -> str:
    """One sentence: how much the free requests of (b) and (d) slowed down, and the
    grammar's timed work per step, both as a fraction of (a)'s step (p50)."""
    base = float(np.median([s.seconds for s in results[VARIANTS[0]].steps]))
    parts = []
    for variant in VARIANTS[1:]:
        if not variant.free:
            continue
        steps = results[variant].steps
        ratio = float(np.median([s.seconds for s in steps])) / base
        grammar = statistics.fmean(s.mask + s.accept for s in steps) / base
        parts.append(
            f"beside {variant.constrained} {variant.kind} requests ({variant.key}) "
            f"{100 * (ratio - 1):+.1f}% per step (p50), the grammar's timed work "
            f"{100 * grammar:+.1f}%"
        )
    return "The free requests, their step against (a)'s: " + "; ".join(parts) + "."


def cost_rows(results: dict[Variant, Measured]) -> list[list[object]]:
    """Per variant: the step split into the forward, the grammar's parts and the rest
    (ms per step, means), and its step time against (a)'s."""
    base_mean = _mean_ms(results[VARIANTS[0]].steps, lambda s: s.seconds)
    rows: list[list[object]] = []
    for variant, measured in results.items():
        steps = measured.steps
        step = _mean_ms(steps, lambda s: s.seconds)
        forward = _mean_ms(steps, lambda s: s.forward)
        fill = _mean_ms(steps, lambda s: s.fill)
        apply = _mean_ms(steps, lambda s: s.mask - s.fill)
        accept = _mean_ms(steps, lambda s: s.accept)
        grammar = fill + apply + accept
        per_row = 1e3 * fill / variant.constrained if variant.constrained else "-"
        warm = _mean_ms(measured.warmup, lambda s: s.mask + s.accept) if measured.warmup else "-"
        rows.append([
            variant.name, step, forward, fill, per_row, apply, accept, grammar,
            f"{100 * grammar / step:.1f}%", step - forward - grammar, step - base_mean, warm,
        ])  # fmt: skip
    return rows


NOTE = """\
Greedy, a batch of {batch} fixed from the first decode step to the last (every request
ends on `length` at {max_tokens} tokens: checked), prompts of {prompt} tokens; per batch
{warmup} warm-up decode steps, then {measured} timed; {rounds} round(s), the variants
in turns; {threads} torch threads; vocabulary (mask width) {vocab}.

`step ÷ (a)`: the variant's step time over (a)'s. Same batch, same forward: what differs
is the grammar work, so for (b) and (d) it is the slowdown the 4 constrained requests
impose on the 4 free ones, which share every step with them (`free tok/s`: the free
requests' tokens alone). Second table: `forward`: `ModelRunner.forward` (the model up to
the logits); `mask fill`: llguidance filling one bitmask row per constrained request
(`GrammarMatcher.fill_bitmask`, the Python around the call included); `mask apply`: the
rest of `Sampler._apply_grammars` (finding the constrained rows, allocating the bitmask,
unpacking its bits and masking those rows' logits with torch); `accept`:
`GrammarMatcher.accept` on each constrained request's token; `grammar`: the three;
`rest`: the step less the forward and the grammar (planner, inputs, the sampler's other
work, bookkeeping); `step - (a)`: the variant's mean step less (a)'s, noise included;
`grammar, warm-up steps`: the grammar per step over the first decode steps, where
llguidance grows each new matcher's lexer. The grammar runs after the forward, before
sampling, on the scheduler's thread: none of it overlaps the model."""


def like_checkpoint(name: str, num_layers: int) -> Path:
    """A random checkpoint with `name`'s widths, so its real vocabulary (the mask's
    width), cut to `num_layers` text layers and one vision block, float32; generated
    into the checkpoint cache on first use (`iris tiny-model --like`)."""
    from iris_serve.scheduler.tiny_checkpoint import GENERATOR_VERSION, STAMP_FILE, cache_root
    from iris_serve.scheduler.tiny_checkpoint.like import generate_like_checkpoint, resolve_name

    name = resolve_name(name)
    target = cache_root() / f"like-{name}-{num_layers}layer-float32"
    expected = {"like": name, "num_layers": num_layers, "vision_depth": 1, "dtype": "float32",
                "seed": 0, "generator_version": GENERATOR_VERSION}  # fmt: skip
    try:
        stamp = json.loads((target / STAMP_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = {}
    if any(stamp.get(key) != value for key, value in expected.items()):
        print(f"generating {target} (once)", flush=True)
        generate_like_checkpoint(
            name, target, dtype="float32", num_layers=num_layers, vision_depth=1
        )  # the stamp is written last: an interrupted run generates again
    return target


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_common_arguments(parser, "tiny checkpoint, one short round (smoke test)")
    add_arch_argument(parser)
    parser.add_argument(
        "--like", metavar="NAME", default=None,
        help="instead of --arch/--size: a random checkpoint with NAME's widths (its real "
        "vocabulary: the mask's real width), cut to --num-layers text layers",
    )  # fmt: skip
    parser.add_argument("--num-layers", type=int, default=1, help="with --like")
    parser.add_argument(
        "--threads", type=int, default=None,
        help="torch threads (default: torch's, every usable core as `iris serve`); 1 is "
        "steadier when another process shares the cores",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=FULL.rounds, help="batches per variant")
    parser.add_argument(
        "--steps", type=int, default=FULL.measured, help="timed decode steps per batch"
    )
    parser.set_defaults(size="small")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    setting = QUICK if args.quick else replace(FULL, rounds=args.rounds, measured=args.steps)
    from iris_serve.scheduler.config import EngineConfig
    from iris_serve.scheduler.engine import Engine
    from iris_serve.scheduler.tiny_checkpoint import builtin_checkpoint

    if args.like and not args.quick:
        from iris_serve.scheduler.tiny_checkpoint.like import resolve_name

        like = resolve_name(args.like)
        model_dir = like_checkpoint(like, args.num_layers)
        layers = f"{args.num_layers} text layer" + ("s" if args.num_layers > 1 else "")
        label, what = f"like_{like}_{args.num_layers}layer", f"{like}'s widths, {layers}"
    else:
        size = "tiny" if args.quick else args.size
        model_dir = builtin_checkpoint(arch=args.arch, size=size)
        label, what = checkpoint_label(args.arch, size), f"{ARCH_TITLES[args.arch]} {size}"
    engine = Engine(EngineConfig(model=str(model_dir), device="cpu", dtype="float32"))
    load_before = os.getloadavg()[0]
    started = time.perf_counter()
    compile_table = one_offs(engine, setting)
    results: dict[Variant, Measured] = {v: Measured() for v in VARIANTS}
    timers = StepTimers()
    with timers.installed():
        run_batch(engine, VARIANTS[1], -1, QUICK, timers)  # untimed: the engine's first steps
        for number in range(setting.rounds):
            shift = number % len(VARIANTS)
            for variant in VARIANTS[shift:] + VARIANTS[:shift]:
                batch = run_batch(engine, variant, number, setting, timers)
                results[variant].steps += batch.steps
                results[variant].warmup += batch.warmup
    took = time.perf_counter() - started

    step_header = ["variant", "timed steps", "step ms mean", "p50", "p90", "tok/s",
                   "free tok/s", "step ÷ (a), p50", "step ÷ (a), mean"]  # fmt: skip
    cost_header = ["variant", "step", "forward", "mask fill", "fill µs per constrained row",
                   "mask apply", "accept", "grammar", "grammar / step", "rest",
                   "step - (a)", "grammar, warm-up steps"]  # fmt: skip
    once_header = ["one-off", "repeats", "ms (median)", "max ms", "first mask ms (median)"]
    note = NOTE.format(
        batch=BATCH, max_tokens=setting.warmup + setting.measured + 2, prompt=PROMPT_LEN,
        warmup=setting.warmup, measured=setting.measured, rounds=setting.rounds,
        threads=torch.get_num_threads(), vocab=engine.grammars.vocab_size,
    )  # fmt: skip
    body = "\n\n".join([
        "## Decode steps: a fixed batch of 8, per variant",
        markdown_table(step_header, step_rows(results)),
        "## Where the step's time goes (ms per decode step, means)",
        markdown_table(cost_header, cost_rows(results)),
        "## Once per engine, once per request",
        markdown_table(once_header, compile_table),
        verdict(results),
        note,
        f"Took {took:.0f} s; 1-minute load average before the run: {load_before:.2f} "
        "(another process on the cores shows in the step times).",
    ])  # fmt: skip
    name = f"structured_output_{label}" + ("_quick" if args.quick else "")
    title = f"Structured output on a mixed batch ({what})"
    write_result(name, title, body, args.out)


if __name__ == "__main__":
    main()
