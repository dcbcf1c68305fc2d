"""Grammar engines for structured output, measured side by side: xgrammar vs llguidance.

Both constrain decoding the same way: per request a matcher that fills one row of a
shared int32 bitmask `[rows, ceil(V/32)]` (bit 1 = allowed) before each step and accepts
the sampled token after it; the bitmask is then applied to the logits (-inf where 0).
This script measures, on generated tokenizers only (nothing downloaded):

- the tiny checkpoint's tokenizer (vocab 1536) and the tokenizer of `iris tiny-model
  --like Qwen2.5-VL-7B-Instruct` (151657 entries, Qwen's special ids, lm_head width
  152064: the mask covers 152064 columns, the last 407 of which no tokenizer entry
  has). That tokenizer's 150k filler entries (" aaab", " aaac", ...) are more regular than
  Qwen's real BPE vocabulary, so mask-fill figures are a lower bound for the real one;
- the tokenizer-info build (one-off per model);
- per grammar (json_object, an OpenAI-style tool-call JSON schema, the regex
  `\\d{3}-\\d{4}`, a choice among 3 strings): compile time and time to the first mask
  (compile + per-request matcher + first fill), median over repeats, without caches;
- per token, on the same token sequences for both engines: one mask-row fill and one
  token accepted (mean, p50, p99), and 16 rows (16 matchers at different points of their
  output) filled one by one vs with the engine's batch API;
- applying a `[16, V]` bitmask to float32 logits on the CPU: each engine's helper vs a
  plain torch implementation (shift, and, masked_fill) that works on any device;
- correctness: random walks (a random allowed token each step; JSON walks kept open
  for ~`--budget` tokens, then steered to close) must parse with json.loads and match the
  schema (checked by hand), EOS must be allowed exactly once the value is complete and
  end the matcher, padded ids (past the tokenizer) must never be allowed, and every walk
  of one engine is replayed on the other, which must allow each of its tokens;
- packaging: version, license, installed size, runtime dependencies, and which of them
  Iris does not already pull (torch / triton / CUDA packages flagged).

    python -m bench.grammar_engines                 # both vocabularies, ~1 min on 2 cores
    python -m bench.grammar_engines --quick         # tiny vocabulary, a smoke test
    python -m bench.grammar_engines --wheels DIR    # also the sizes of the wheels in DIR

Neither engine is a dependency of Iris: install them next to a CPU torch without letting
pip resolve torch again (`pip install -c <(echo torch==$(python -c 'import torch;
print(torch.__version__)')) xgrammar llguidance`). An engine that does not import is
reported as missing and skipped.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from bench.results_io import markdown_table, write_result

ENGINES = ("xgrammar", "llguidance")
LIKE_NAME = "Qwen2.5-VL-7B-Instruct"

TOOL_CALL_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "enum": ["get_weather", "search_web", "send_email"]},
        "arguments": {
            "type": "object",
            "properties": {
                "location": {"type": "string"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                "days": {"type": "integer"},
                "include_hourly": {"type": "boolean"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["location", "days"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
REGEX = r"\d{3}-\d{4}"
CHOICES = ["positive", "negative", "neutral"]
GRAMMARS = ("json_object", "json_schema", "regex", "choice")
JSON_GRAMMARS = ("json_object", "json_schema")

MAX_DEPTH = 4  # random walks nest JSON at most this deep
_SHIFTS = torch.arange(32, dtype=torch.int32)


# --- the plain torch mask application (any device) -------------------------------------


def apply_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits[i, j] = -inf where bit j of row i is 0; bitmask int32 [B, ceil(V/32)]."""
    bits = (bitmask.unsqueeze(-1) >> _SHIFTS.to(bitmask.device)) & 1
    allowed = bits.view(bitmask.shape[0], -1)[:, : logits.shape[1]].bool()
    logits.masked_fill_(~allowed, float("-inf"))


def allowed_ids(row: torch.Tensor, vocab: int) -> torch.Tensor:
    return (((row.unsqueeze(-1) >> _SHIFTS) & 1).view(-1)[:vocab]).nonzero().view(-1)


# --- the two engines behind one interface ---------------------------------------------


class Engine:
    """One grammar library: tokenizer info, compile, matcher, fill, accept, apply."""

    name = ""

    def __init__(self, tokenizer: Any, vocab: int, eos_ids: list[int], threads: int) -> None:
        self.tokenizer, self.vocab, self.eos_ids, self.threads = tokenizer, vocab, eos_ids, threads

    def build_info(self) -> None: ...
    def compile(self, kind: str) -> Any: ...
    def matcher(self, compiled: Any) -> Any: ...
    def cached(self, compiled: Any) -> Callable[[], Any]: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor, index: int) -> None: ...
    def accept(self, matcher: Any, token: int) -> bool: ...
    def ended(self, matcher: Any) -> bool: ...
    def batch_fill(self, matchers: list[Any], bitmask: torch.Tensor, threads: int) -> None: ...
    def rollback(self, matcher: Any, n: int) -> None: ...
    def apply_helpers(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]: ...


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import xgrammar

        self.xgr = xgrammar
        self.batch = {n: xgrammar.BatchGrammarMatcher(max_threads=n) for n in {1, self.threads}}

    def build_info(self) -> None:
        self.info = self.xgr.TokenizerInfo.from_huggingface(
            self.tokenizer, vocab_size=self.vocab, stop_token_ids=self.eos_ids
        )
        self.compiler = self.xgr.GrammarCompiler(
            self.info, max_threads=self.threads, cache_enabled=False
        )

    def compile(self, kind: str) -> Any:
        c = self.compiler
        if kind == "json_object":
            return c.compile_json_schema('{"type": "object"}')
        if kind == "json_schema":
            return c.compile_json_schema(json.dumps(TOOL_CALL_SCHEMA))
        if kind == "regex":
            return c.compile_regex(REGEX)
        # choice: an EBNF alternation of JSON-escaped literals, as vLLM builds it
        return c.compile_grammar("root ::= " + " | ".join(json.dumps(s) for s in CHOICES))

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def cached(self, compiled: Any) -> Callable[[], Any]:
        """A per-request matcher from a cache: the CompiledGrammar is the cacheable part."""
        return lambda: self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor, index: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, index)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.accept_token(token)

    def ended(self, matcher: Any) -> bool:
        return matcher.is_terminated()

    def batch_fill(self, matchers: list[Any], bitmask: torch.Tensor, threads: int) -> None:
        self.batch[threads].batch_fill_next_token_bitmask(matchers, bitmask)

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)

    def apply_helpers(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        return {
            "xgrammar apply_token_bitmask_inplace (C++ on CPU)": self.xgr.apply_token_bitmask_inplace
        }


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        import llguidance
        import llguidance.hf
        import llguidance.numpy
        import llguidance.torch

        self.llg = llguidance
        self.executor = {n: llguidance.LLExecutor(num_threads=n) for n in {1, self.threads}}

    def build_info(self) -> None:
        self.lltok = self.llg.hf.from_tokenizer(
            self.tokenizer, n_vocab=self.vocab, eos_token=self.eos_ids
        )

    def compile(self, kind: str) -> Any:
        """llguidance has no compiled-grammar object: the matcher's constructor compiles (the
        lexer is then built lazily, during the first masks). The 'compiled' handle is the
        grammar string; each request builds its own matcher from it."""
        if kind == "json_object":
            grammar = self.llg.grammar_from("json_schema", '{"type": "object"}')
        elif kind == "json_schema":
            grammar = self.llg.grammar_from("json_schema", json.dumps(TOOL_CALL_SCHEMA))
        elif kind == "regex":
            # `\d` is any Unicode digit (Rust regex) unless rewritten as JSON Schema reads it
            lark = self.llg.regex_to_lark(REGEX, "dw")
            grammar = self.llg.LLMatcher.grammar_from_lark(f"start: /{lark}/")
        else:
            grammar = self.llg.grammar_from("choice", json.dumps(CHOICES))
        return grammar

    def cached(self, compiled: Any) -> Callable[[], Any]:
        """A per-request matcher from a cache: a deep copy of one compiled matcher."""
        template = self.matcher(compiled)
        return template.deep_copy

    def matcher(self, compiled: Any) -> Any:
        m = self.llg.LLMatcher(self.lltok, compiled, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def fill(self, matcher: Any, bitmask: torch.Tensor, index: int) -> None:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, index)

    def accept(self, matcher: Any, token: int) -> bool:
        return matcher.consume_token(token)

    def ended(self, matcher: Any) -> bool:
        return matcher.is_stopped() and not matcher.is_error()

    def batch_fill(self, matchers: list[Any], bitmask: torch.Tensor, threads: int) -> None:
        self.llg.torch.fill_next_token_bitmask_par(
            self.executor[threads], [(m, i) for i, m in enumerate(matchers)], bitmask
        )

    def rollback(self, matcher: Any, n: int) -> None:
        matcher.rollback(n)

    def apply_helpers(self) -> dict[str, Callable[[torch.Tensor, torch.Tensor], None]]:
        def numpy_apply(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
            self.llg.numpy.apply_token_bitmask_inplace(logits.numpy(), bitmask.numpy())

        return {
            "llguidance.torch apply_token_bitmask_inplace (torch.compile)": (
                self.llg.torch.apply_token_bitmask_inplace
            ),
            "llguidance.numpy apply_token_bitmask_inplace": numpy_apply,
        }


ENGINE_CLASSES: dict[str, type[Engine]] = {"xgrammar": XGrammar, "llguidance": LLGuidance}


# --- tokenizers -------------------------------------------------------------------------


@dataclass
class Vocab:
    label: str
    tokenizer: Any
    vocab: int  # lm_head width = mask columns
    eos_ids: list[int]
    token_bytes: list[bytes] = field(default_factory=list)


def make_vocabs(quick: bool) -> list[Vocab]:
    from iris_serve.scheduler.tiny_checkpoint.like import like_config, text_config
    from iris_serve.scheduler.tiny_checkpoint.tokenizer import (
        EOS_TOKEN,
        PAD_TOKEN,
        REAL_FIRST_SPECIAL_ID,
        VOCAB_SIZE,
        build_tokenizer,
        token_id,
    )

    # generation_config.json of the generated checkpoints: EOS ids [<|im_end|>, <|endoftext|>]
    vocabs = [
        Vocab("tiny (1536)", build_tokenizer(), VOCAB_SIZE,
              [token_id(EOS_TOKEN), token_id(PAD_TOKEN)]),
    ]  # fmt: skip
    if not quick:
        width = text_config(like_config(LIKE_NAME))["vocab_size"]
        tokenizer = build_tokenizer(first_special_id=REAL_FIRST_SPECIAL_ID)
        eos = [
            token_id(EOS_TOKEN, REAL_FIRST_SPECIAL_ID),
            token_id(PAD_TOKEN, REAL_FIRST_SPECIAL_ID),
        ]
        vocabs.append(Vocab(f"--like {LIKE_NAME} ({width})", tokenizer, width, eos))
    for v in vocabs:
        v.token_bytes = token_bytes(v.tokenizer, v.vocab)
    return vocabs


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet (printable stand-ins for bytes), inverted."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    chars, extra = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(keep, chars, strict=True)}


def token_bytes(tokenizer: Any, vocab: int) -> list[bytes]:
    """The bytes of every id < vocab (special and padded ids: b"")."""
    decoder = _byte_decoder()
    special = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
    pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    out = [
        b"" if i in special or p is None else bytes(decoder[c] for c in p)
        for i, p in enumerate(pieces)
    ]
    return out + [b""] * (vocab - len(out))


# --- random walks -----------------------------------------------------------------------


def scan(state: tuple[int, bool, bool, bool], data: bytes) -> tuple[int, bool, bool, bool]:
    """JSON nesting outside strings: (depth, in_string, escape, closed the top level)."""
    depth, in_str, esc, closed = state
    for b in data:
        if in_str:
            if esc:
                esc = False
            elif b == 0x5C:
                esc = True
            elif b == 0x22:
                in_str = False
        elif b == 0x22:
            in_str = True
        elif b in (0x7B, 0x5B):
            depth += 1
        elif b in (0x7D, 0x5D):
            depth -= 1
            closed = closed or depth == 0
    return depth, in_str, esc, closed


@dataclass
class Walk:
    tokens: list[int]
    ended: bool  # EOS accepted and the matcher says it is done
    pad_allowed: bool  # an id past the tokenizer was ever allowed
    eos_early: bool  # EOS allowed while the JSON was not complete


def random_walk(
    engine: Engine, compiled: Any, v: Vocab, kind: str, rng: random.Random, budget: int
) -> Walk:
    """A random allowed token each step; JSON is kept open (and at most MAX_DEPTH deep)
    for `budget` tokens, then steered shut (closing bytes preferred, no deeper nesting)."""
    ws, closer = _token_classes(v)
    m = engine.matcher(compiled)
    bitmask = torch.zeros(1, math.ceil(v.vocab / 32), dtype=torch.int32)
    tokens: list[int] = []
    state = (0, False, False, False)
    real = len(v.tokenizer)
    pad_allowed = eos_early = False
    for step in range(budget + 400):
        engine.fill(m, bitmask, 0)
        ids = allowed_ids(bitmask[0], v.vocab)
        pad_allowed = pad_allowed or bool((ids >= real).any())
        eos = [e for e in v.eos_ids if bool(((bitmask[0, e // 32] >> (e % 32)) & 1).item())]
        if eos:
            if kind in JSON_GRAMMARS and (state[0] != 0 or state[1] or not state[3]):
                eos_early = True
            ok = engine.accept(m, eos[0])
            tokens.append(eos[0])
            return Walk(tokens, ok and engine.ended(m), pad_allowed, eos_early)
        if not len(ids):
            break
        token = _pick(ids, ws, closer, state, step >= budget, kind, v, rng)
        if not engine.accept(m, token):
            raise RuntimeError(f"{engine.name} rejected a token its own mask allowed: {token}")
        tokens.append(token)
        state = scan(state, v.token_bytes[token])
    return Walk(tokens, False, pad_allowed, eos_early)


_CLASSES: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}


def _token_classes(v: Vocab) -> tuple[torch.Tensor, torch.Tensor]:
    """Whitespace-only tokens, and tokens made only of closing bytes (`"`, `}`, `]`)."""
    key = id(v)
    if key not in _CLASSES:
        ws = torch.tensor([bool(b) and not b.strip() for b in v.token_bytes])
        closer = torch.tensor([bool(b) and not b.strip(b'"}]') for b in v.token_bytes])
        _CLASSES[key] = (ws, closer)
    return _CLASSES[key]


def _pick(
    ids: torch.Tensor,
    ws: torch.Tensor,
    closer: torch.Tensor,
    state: tuple[int, bool, bool, bool],
    closing: bool,
    kind: str,
    v: Vocab,
    rng: random.Random,
) -> int:
    non_ws = ids[~ws[ids]]
    pool = non_ws if len(non_ws) else ids
    if kind not in JSON_GRAMMARS:
        return int(pool[rng.randrange(len(pool))])
    if closing:
        closers = ids[closer[ids]]
        if len(closers):
            return int(closers[rng.randrange(len(closers))])
    for _ in range(64):
        token = int(pool[rng.randrange(len(pool))])
        depth, _, _, closed = scan(state, v.token_bytes[token])
        if closing and depth <= max(state[0], 1):
            return token
        if not closing and not closed and depth <= MAX_DEPTH:
            return token
    return int(pool[rng.randrange(len(pool))])


def walk_text(v: Vocab, tokens: Sequence[int]) -> str:
    return b"".join(v.token_bytes[t] for t in tokens if t not in v.eos_ids).decode(
        "utf-8", "replace"
    )


def valid(kind: str, text: str) -> bool:
    if kind == "regex":  # `\\d` as JSON Schema / JavaScript read it: ASCII digits
        return re.fullmatch(REGEX, text, flags=re.ASCII) is not None
    if kind == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    if not isinstance(value, dict):
        return False
    return kind == "json_object" or matches_tool_call(value)


def matches_tool_call(value: dict[str, Any]) -> bool:
    """TOOL_CALL_SCHEMA checked by hand: keys, required keys, types, enums."""
    props = TOOL_CALL_SCHEMA["properties"]
    if set(value) != {"name", "arguments"} or value["name"] not in props["name"]["enum"]:
        return False
    args = value["arguments"]
    if not isinstance(args, dict) or not {"location", "days"} <= set(args) <= set(
        props["arguments"]["properties"]
    ):
        return False
    checks: dict[str, Callable[[Any], bool]] = {
        "location": lambda x: isinstance(x, str),
        "unit": lambda x: x in ("celsius", "fahrenheit"),
        "days": lambda x: isinstance(x, int) and not isinstance(x, bool),
        "include_hourly": lambda x: isinstance(x, bool),
        "tags": lambda x: isinstance(x, list) and all(isinstance(i, str) for i in x),
    }
    return all(checks[k](x) for k, x in args.items())


# --- measurements -----------------------------------------------------------------------


def _us(ns: Sequence[int]) -> tuple[float, float, float]:
    values = sorted(n / 1e3 for n in ns)
    p99 = values[min(len(values) - 1, math.ceil(0.99 * len(values)) - 1)]
    return statistics.fmean(values), statistics.median(values), p99


def time_build_info(engine: Engine, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.build_info()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def time_compile(engine: Engine, v: Vocab, kind: str, repeats: int) -> tuple[float, float, float]:
    """Median ms: compile; compile + matcher + first mask; a matcher from a cached compile."""
    bitmask = torch.zeros(1, math.ceil(v.vocab / 32), dtype=torch.int32)
    compile_ms, first_ms, matcher_ms = [], [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        compiled = engine.compile(kind)
        t1 = time.perf_counter()
        m = engine.matcher(compiled)
        t2 = time.perf_counter()
        engine.fill(m, bitmask, 0)
        t3 = time.perf_counter()
        compile_ms.append((t1 - t0) * 1e3)
        first_ms.append((t3 - t0) * 1e3)
        matcher_ms.append((t2 - t1) * 1e3)
    if engine.name == "llguidance":  # the matcher's constructor is the compile
        compile_ms = [c + m for c, m in zip(compile_ms, matcher_ms, strict=True)]
    new_request = engine.cached(compiled)
    cached_ms = []
    for _ in range(max(repeats, 20)):
        t0 = time.perf_counter()
        new_request()
        cached_ms.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(compile_ms), statistics.median(first_ms), statistics.median(cached_ms)


def accepts(engine: Engine, compiled: Any, v: Vocab, tokens: Sequence[int]) -> bool:
    """Whether the engine's masks allow every token of the sequence (and it accepts them)."""
    bitmask = torch.zeros(1, math.ceil(v.vocab / 32), dtype=torch.int32)
    m = engine.matcher(compiled)
    for token in tokens:
        engine.fill(m, bitmask, 0)
        if not (int(bitmask[0, token // 32]) >> (token % 32)) & 1 or not engine.accept(m, token):
            return False
    return True


def replay(
    engine: Engine, compiled: Any, v: Vocab, walks: Sequence[list[int]], repeats: int
) -> tuple[list[int], list[int], list[int]]:
    """Each token sequence on a fresh matcher, `repeats` times: per token the fastest mask
    fill and accept (ns) of the repeats, which filters out preemption by other processes;
    and the fills of each request's first 3 tokens."""
    fill_ns, accept_ns, first_ns = [], [], []
    bitmask = torch.zeros(1, math.ceil(v.vocab / 32), dtype=torch.int32)
    for tokens in walks:
        fills = [math.inf] * len(tokens)
        accepts_ = [math.inf] * len(tokens)
        for _ in range(repeats):
            m = engine.matcher(compiled)
            for i, token in enumerate(tokens):
                t0 = time.perf_counter_ns()
                engine.fill(m, bitmask, 0)
                t1 = time.perf_counter_ns()
                engine.accept(m, token)
                t2 = time.perf_counter_ns()
                fills[i] = min(fills[i], t1 - t0)
                accepts_[i] = min(accepts_[i], t2 - t1)
        fill_ns += fills
        accept_ns += accepts_
        first_ns += fills[:3]
    return fill_ns, accept_ns, first_ns


def time_batch16(
    engine: Engine, compiled: Any, v: Vocab, walks: Sequence[list[int]], rounds: int
) -> tuple[list[float], bool, torch.Tensor]:
    """16 matchers spread over the walks; per round the 16 rows filled one by one, with the
    batch API on 1 thread and on `engine.threads` (in a rotating order), then each matcher
    accepts its next token. Returns the median ms of each way, whether all gave the same
    masks, and the last mask."""
    rows = 16
    usable = [w for w in walks if len(w) > rounds + 2] or list(walks)
    per_walk = math.ceil(rows / len(usable))
    plans = []
    for k in range(rows):
        tokens = usable[k % len(usable)]
        room = max(0, len(tokens) - rounds - 2)
        plans.append((tokens, (k // len(usable)) * room // per_walk))
    matchers = []
    for tokens, start in plans:
        m = engine.matcher(compiled)
        for t in tokens[:start]:
            engine.accept(m, t)
        matchers.append(m)
    width = math.ceil(v.vocab / 32)

    def one_by_one(mask: torch.Tensor) -> None:
        for i, m in enumerate(matchers):
            engine.fill(m, mask, i)

    ways: list[Callable[[torch.Tensor], None]] = [
        one_by_one,
        lambda mask: engine.batch_fill(matchers, mask, 1),
        lambda mask: engine.batch_fill(matchers, mask, engine.threads),
    ]
    masks = [torch.zeros(rows, width, dtype=torch.int32) for _ in ways]
    times: list[list[float]] = [[] for _ in ways]
    same = True
    for r in range(rounds):
        for j in range(len(ways)):
            w = (j + r) % len(ways)
            t0 = time.perf_counter()
            ways[w](masks[w])
            times[w].append((time.perf_counter() - t0) * 1e3)
        same = same and all(torch.equal(masks[0], m) for m in masks[1:])
        for (tokens, start), m in zip(plans, matchers, strict=True):
            position = start + r
            if position < len(tokens) - 1:  # never the final EOS: keep every row live
                engine.accept(m, tokens[position])
    return [statistics.median(t) for t in times], same, masks[0].clone()


def time_apply(
    helpers: dict[str, Callable[[torch.Tensor, torch.Tensor], None]],
    bitmask: torch.Tensor,
    vocab: int,
    repeats: int,
) -> list[list[object]]:
    """Per helper: first call ms, median ms on the grammar masks, median ms on random bits
    (half the logits masked at random: the worst case for a branchy CPU loop), and whether
    both results equal the plain torch version's."""
    gen = torch.Generator().manual_seed(0)
    source = torch.randn(bitmask.shape[0], vocab, generator=gen)
    noise = torch.randint(-(2**31), 2**31 - 1, bitmask.shape, dtype=torch.int32, generator=gen)
    rows: list[list[object]] = []
    for name, fn in helpers.items():
        row: list[object] = [name]
        same = True
        for k, mask in enumerate((bitmask, noise)):
            reference = source.clone()
            apply_bitmask_torch(reference, mask)
            logits = source.clone()
            try:
                t0 = time.perf_counter()
                fn(logits, mask)
                first = (time.perf_counter() - t0) * 1e3
            except Exception as e:  # e.g. torch.compile without a C++ compiler
                row = [name, float("nan"), float("nan"), float("nan"), f"failed: {e!r:.80}"]
                break
            same = same and torch.equal(logits, reference)
            if k == 0:
                row.append(first)
            for _ in range(3):  # warm-up (torch.compile may still be settling)
                fn(logits, mask)
            times = []
            for _ in range(repeats):
                logits.copy_(source)
                t0 = time.perf_counter()
                fn(logits, mask)
                times.append((time.perf_counter() - t0) * 1e3)
            row.append(f"{min(times):.3g} / {statistics.median(times):.3g}")
        else:
            row.append("yes" if same else "NO")
        rows.append(row)
    return rows


def unicode_regex_row(engine: Engine, v: Vocab, count: int, seed: int) -> list[object]:
    """llguidance's plain `grammar_from("regex", ...)`: its `\\d` is any Unicode digit."""
    grammar = engine.llg.grammar_from("regex", REGEX)  # type: ignore[attr-defined]
    rng = random.Random(f"{seed}-unicode-{v.vocab}")
    own = [random_walk(engine, grammar, v, "regex", rng, 0) for _ in range(count)]
    texts = [walk_text(v, w.tokens) for w in own]
    example = next((t for t in texts if not valid("regex", t)), "")
    what = "regex via plain grammar_from('regex'), no ASCII rewrite" + (
        f" (e.g. {example!r})" if example else ""
    )
    return [
        engine.name, v.label, what, len(own), f"{statistics.fmean(len(w.tokens) for w in own):.0f}",
        sum(w.ended for w in own), sum(valid("regex", t) for t in texts), "", "", "",
    ]  # fmt: skip


def invalid_token_behaviour(engine: Engine, v: Vocab) -> str:
    """Accept `{`, then a token the mask forbids, then a valid one; then rollback."""
    compiled = engine.compile("json_object")
    open_brace = v.token_bytes.index(b"{")
    key_start = v.token_bytes.index(b'"')
    bad = v.token_bytes.index(b"x")
    m = engine.matcher(compiled)
    engine.accept(m, open_brace)
    rejected = not engine.accept(m, bad)
    then_ok = engine.accept(m, key_start)
    width = math.ceil(v.vocab / 32)
    fresh, after = (
        torch.zeros(1, width, dtype=torch.int32),
        torch.zeros(1, width, dtype=torch.int32),
    )
    m2 = engine.matcher(compiled)
    engine.fill(m2, fresh, 0)
    engine.accept(m2, open_brace)
    engine.accept(m2, key_start)
    engine.rollback(m2, 2)
    engine.fill(m2, after, 0)
    return (
        f"invalid token {'rejected' if rejected else 'ACCEPTED'}, matcher "
        f"{'still usable' if then_ok else 'dead (error state)'}; rollback(2) "
        f"{'restores the first mask' if torch.equal(fresh, after) else 'DIFFERS'}"
    )


# --- packaging --------------------------------------------------------------------------


def _runtime_requires(dist: str) -> list[str]:
    from packaging.requirements import Requirement

    names = []
    for line in metadata.requires(dist) or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return names


def _closure(dist: str) -> set[str]:
    seen: set[str] = set()
    todo = [dist]
    while todo:
        name = _norm(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        with contextlib.suppress(metadata.PackageNotFoundError):
            todo += _runtime_requires(name)
    return seen


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _installed_mb(dist: str) -> float:
    try:
        files = metadata.distribution(dist).files or []
    except metadata.PackageNotFoundError:
        return float("nan")
    return sum(f.size or 0 for f in files) / 1e6


_WITHOUT_TRITON = """
import sys
sys.modules["triton"] = None  # as if `pip install --no-deps` had left it out
import torch, xgrammar
from iris_serve.scheduler.tiny_checkpoint.tokenizer import build_tokenizer
info = xgrammar.TokenizerInfo.from_huggingface(build_tokenizer(), vocab_size=1536)
compiled = xgrammar.GrammarCompiler(info).compile_json_schema('{"type": "object"}')
matcher = xgrammar.GrammarMatcher(compiled)
bitmask = xgrammar.allocate_token_bitmask(1, 1536)
matcher.fill_next_token_bitmask(bitmask)
xgrammar.apply_token_bitmask_inplace(torch.zeros(1, 1536), bitmask)
"""


def runs_without_triton(name: str) -> str:
    """Whether the engine works on the CPU with triton absent (its own deps aside)."""
    if name != "xgrammar":
        return "n/a (not a dependency)"
    done = subprocess.run(
        [sys.executable, "-c", _WITHOUT_TRITON], capture_output=True, text=True, check=False
    )
    return "yes" if done.returncode == 0 else f"no: {done.stderr.strip().splitlines()[-1]:.80}"


def packaging_row(name: str, wheels: Path | None) -> list[object]:
    try:
        dist = metadata.distribution(name)
    except metadata.PackageNotFoundError:
        return [name, "not installed", "", "", "", "", "", "", ""]
    meta = dist.metadata
    license_ = meta.get("License-Expression") or meta.get("License") or "?"
    wheel = "n/a"
    if wheels is not None:
        found = sorted(wheels.glob(f"{name}-{dist.version}-*.whl"))
        wheel = f"{found[0].stat().st_size / 1e6:.2f} MB" if found else "not in --wheels"
    requires = _runtime_requires(name)
    new = sorted(_closure(name) - _closure("iris-serve") - {_norm(name)})
    new_cells = ", ".join(f"{n} ({_installed_mb(n):.0f} MB)" for n in new) or "none"
    heavy = [n for n in _closure(name) if re.match(r"(torch|triton|nvidia-|cuda)", n)]
    return [
        name, dist.version, license_, wheel, f"{_installed_mb(name):.1f} MB",
        ", ".join(requires) or "none", new_cells, ", ".join(sorted(heavy)) or "none",
        runs_without_triton(name),
    ]  # fmt: skip


# --- main -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny vocabulary, one of each")
    parser.add_argument("--engines", nargs="+", choices=ENGINES, default=list(ENGINES))
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="engine threads (compiler, batch fill); default: every core")  # fmt: skip
    parser.add_argument("--budget", type=int, default=200, help="JSON walk length before closing")
    parser.add_argument("--walks", type=int, default=4, help="random walks per JSON grammar")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--wheels", type=Path, default=None, help="folder with the wheels")
    parser.add_argument("--out", type=Path, default=None, help="results folder")
    args = parser.parse_args(argv)
    # a cold inductor cache, so that the torch.compile helper's first call is what a fresh
    # server pays (kept for the process; left for the OS to clean)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="grammar_engines_inductor_")
    if args.quick:
        args.budget, args.walks = min(args.budget, 40), 1
    repeats = 2 if args.quick else 5
    rounds = 4 if args.quick else 16
    replays = 1 if args.quick else 3
    started = time.perf_counter()
    load = os.getloadavg()[0]

    versions, available = {}, []
    for name in args.engines:
        try:
            importlib.import_module(name)
            versions[name] = metadata.version(name)
            available.append(name)
        except ImportError as e:
            versions[name] = f"not importable ({e})"
    if not available:
        print(
            "no grammar engine imports: " + "; ".join(versions.values()) + "\ninstall them next "
            "to the CPU torch: pip install -c <(echo torch==$(python -c 'import torch; "
            "print(torch.__version__)')) xgrammar llguidance",
            file=sys.stderr,
        )
        return 2
    vocabs = make_vocabs(args.quick)

    info_rows, compile_rows, token_rows, batch_rows, apply_rows, check_rows = [], [], [], [], [], []
    for v in vocabs:
        engines = {
            n: ENGINE_CLASSES[n](v.tokenizer, v.vocab, v.eos_ids, args.threads) for n in available
        }
        for e in engines.values():
            info_rows.append([e.name, v.label, time_build_info(e, 1 if args.quick else 3)])
        compiled = {n: {k: e.compile(k) for k in GRAMMARS} for n, e in engines.items()}
        last_mask = torch.full((16, math.ceil(v.vocab / 32)), -1, dtype=torch.int32)
        for e in engines.values():
            row: list[object] = [e.name, v.label]
            for kind in GRAMMARS:
                c, first, cached_ms = time_compile(e, v, kind, repeats)
                row.append(f"{c:.2f} / {first:.2f}")
                if kind == "json_schema":
                    per_request = cached_ms
            compile_rows.append([*row, f"{per_request * 1e3:.0f}"])
        # random walks of every engine, each replayed on every engine
        walks: dict[str, dict[str, list[Walk]]] = {k: {} for k in GRAMMARS}
        for kind in GRAMMARS:
            count = args.walks if kind in JSON_GRAMMARS else 2 * args.walks
            for n, e in engines.items():
                rng = random.Random(f"{args.seed}-{n}-{kind}-{v.vocab}")
                walks[kind][n] = [
                    random_walk(e, compiled[n][kind], v, kind, rng, args.budget)
                    for _ in range(count)
                ]
        behaviour = {n: invalid_token_behaviour(e, v) for n, e in engines.items()}
        for kind in GRAMMARS:
            tagged = [(src, w.tokens) for src, ws in walks[kind].items() for w in ws]
            every = [tokens for _, tokens in tagged]
            ok = {
                n: [accepts(e, compiled[n][kind], v, t) for t in every] for n, e in engines.items()
            }
            common = [t for i, t in enumerate(every) if all(ok[n][i] for n in engines)]
            for n, e in engines.items():
                own = walks[kind][n]
                others = [
                    f"{sum(ok[n][i] for i, (src, _) in enumerate(tagged) if src == o)}"
                    f"/{len(walks[kind][o])}"
                    for o in engines
                    if o != n
                ]
                check_rows.append([
                    n, v.label, kind, len(own), f"{statistics.fmean(len(w.tokens) for w in own):.0f}",
                    sum(w.ended for w in own), sum(valid(kind, walk_text(v, w.tokens)) for w in own),
                    "never" if not any(w.eos_early for w in own) else "EARLY",
                    "never" if not any(w.pad_allowed for w in own) else "ALLOWED",
                    ", ".join(others) or "-",
                ])  # fmt: skip
                if kind in JSON_GRAMMARS and common:
                    fill_ns, accept_ns, first_ns = replay(e, compiled[n][kind], v, common, replays)
                    fill, accept = _us(fill_ns), _us(accept_ns)
                    total = _us([a + b for a, b in zip(fill_ns, accept_ns, strict=True)])
                    token_rows.append(
                        [n, v.label, kind, f"{len(common)}/{len(every)}", len(fill_ns),
                         *fill, _us(first_ns)[0], accept[0], *total]
                    )  # fmt: skip
                if kind == "json_object" and common:
                    ms, same, mask = time_batch16(e, compiled[n][kind], v, common, rounds)
                    batch_rows.append([n, v.label, *ms, "yes" if same else "NO"])
                    if n == available[0]:
                        last_mask = mask
        if "llguidance" in engines:
            check_rows.append(
                unicode_regex_row(engines["llguidance"], v, 2 * args.walks, args.seed)
            )
        if engines:
            helpers: dict[str, Callable[[torch.Tensor, torch.Tensor], None]] = {
                "plain torch (shift, and, masked_fill)": apply_bitmask_torch
            }
            for e in engines.values():
                helpers.update(e.apply_helpers())
            if args.quick:  # torch.compile takes ~20 s on 2 cores
                helpers = {k: f for k, f in helpers.items() if "torch.compile" not in k}
            for row in time_apply(helpers, last_mask, v.vocab, 20):
                apply_rows.append([v.label, *row])
            for n, text in behaviour.items():
                check_rows.append([n, v.label, f"after `{{`: {text}", "", "", "", "", "", "", ""])

    sections = [
        f"Engines: {', '.join(f'{n} {versions[n]}' for n in args.engines)}; transformers "
        f"{metadata.version('transformers')}; {args.threads} engine threads; "
        f"JSON walks of ~{args.budget} tokens, {args.walks} per engine per JSON grammar "
        f"(2x that for regex/choice); compile repeats {repeats}, no caches; took "
        f"{time.perf_counter() - started:.0f} s; load average at the start {load:.2f} "
        "(another process on the machine makes multi-threaded figures noisy).",
        "## Packaging\n\n"
        + markdown_table(
            [
                "package",
                "version",
                "license",
                "wheel",
                "installed",
                "runtime deps",
                "pulled beyond Iris's own deps (installed size)",
                "torch/triton/CUDA in its closure",
                "runs on the CPU with triton absent",
            ],
            [packaging_row(n, args.wheels) for n in args.engines],
        ),
        "## One-off per model: tokenizer info (ms, median)\n\n"
        + markdown_table(["engine", "vocab", "tokenizer info ms"], info_rows),
        "## Compile (ms): compile / to first mask (compile + matcher + first fill), median\n\n"
        "xgrammar compiles to a cacheable CompiledGrammar, then builds a GrammarMatcher per "
        "request; llguidance compiles in the LLMatcher constructor (its lexer then grows lazily "
        "during the first masks), so a cache keeps one matcher and deep-copies it per request "
        "(last column).\n\n"
        + markdown_table(
            [
                "engine",
                "vocab",
                *GRAMMARS,
                "per-request matcher from a cached compile µs (json_schema)",
            ],
            compile_rows,
        ),
        "## Per token (µs): one mask row filled, one token accepted\n\n"
        f"The walks of both engines that both accept in full (the same tokens for both engines), "
        f"each replayed {replays} times on a fresh matcher; per token the fastest of the "
        f"{replays} counts (filters out preemption by other processes).\n\n"
        + markdown_table(
            [
                "engine",
                "vocab",
                "grammar",
                "walks replayed",
                "tokens",
                "fill mean",
                "fill p50",
                "fill p99",
                "fill mean, first 3 of a request",
                "accept mean",
                "fill+accept mean",
                "fill+accept p50",
                "fill+accept p99",
            ],
            token_rows,
        ),
        f"## 16 mask rows (json_object, 16 matchers at different points, median of {rounds} "
        "steps, ms)\n\n"
        + markdown_table(
            [
                "engine",
                "vocab",
                "16 single fills",
                "batch API, 1 thread",
                f"batch API, {args.threads} threads",
                "same masks",
            ],
            batch_rows,
        ),
        "## Applying a [16, V] bitmask to float32 logits on the CPU (ms)\n\n"
        "20 calls on the last 16 json_object masks above, and on random bits (half the "
        "logits masked, no runs: the worst case for a CPU loop). The torch.compile helper's "
        "first call compiles (inductor, with a fresh cache here: a C++ compiler is needed at "
        "run time), once per process. torch's kernels (plain, compiled) run on every core "
        "(OpenMP), so another process on the machine hits their medians hardest.\n\n"
        + markdown_table(
            [
                "vocab",
                "implementation",
                "first call",
                "grammar masks: min / median",
                "random bits: min / median",
                "same as plain torch",
            ],
            apply_rows,
        ),
        "## Correctness\n\n"
        "`walks`: random walks by that engine; `ended`: EOS accepted and the matcher done; "
        "`valid`: json.loads + the tool-call schema checked by hand (regex: full match; choice: "
        "one of the 3); `EOS early`: EOS allowed before the value was complete; `pad ids`: an "
        "id past the tokenizer (up to the lm_head width) allowed; last column: the other "
        "engine's walks whose every token this engine's mask allowed (llguidance only allows the "
        "canonical tokenization of bytes the grammar forces, e.g. a fixed key or the rest of a "
        "choice, so it refuses walks that spell those differently; both outputs are valid).\n\n"
        + markdown_table(
            [
                "engine",
                "vocab",
                "grammar",
                "walks",
                "mean tokens",
                "ended",
                "valid",
                "EOS early",
                "pad ids",
                "the other engine's walks it allows",
            ],
            check_rows,
        ),
    ]
    name = "grammar_engines_quick" if args.quick else "grammar_engines"
    write_result(name, "Grammar engines: xgrammar vs llguidance", "\n\n".join(sections), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
