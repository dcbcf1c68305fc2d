"""Structured output on the tiny model: its weights are random, so an unconstrained answer
is never valid JSON; under a grammar every sample is, whatever the temperature, and the
rows without a grammar in the same batch sample exactly as if alone."""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoTokenizer

from iris_serve.common.grammars import grammar_error
from iris_serve.ipc.local import PromptInput
from iris_serve.ipc.messages import Sampling, StructuredOutput
from iris_serve.scheduler.config import EngineConfig
from iris_serve.scheduler.sampling.sampler import Sampler, SamplingRow
from iris_serve.scheduler.sampling.structured_output import Grammars, apply_bitmask, new_bitmask
from iris_serve.scheduler.step.engine import Engine

torch.set_num_threads(2)

SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
        "units": {"enum": ["C", "F"]},
    },
    "required": ["city", "days", "units"],
    "additionalProperties": False,
}


def valid(answer: dict) -> bool:
    """SCHEMA checked by hand (no jsonschema dependency)."""
    return (
        set(answer) == {"city", "days", "units"}
        and isinstance(answer["city"], str) and len(answer["city"]) <= 12
        and type(answer["days"]) is int and 1 <= answer["days"] <= 9
        and answer["units"] in ("C", "F")
    )  # fmt: skip


@pytest.fixture(scope="module")
def engine(qwen2_vl_tiny) -> Engine:
    return Engine(EngineConfig(model=str(qwen2_vl_tiny), device="cpu", max_model_len=512))


@pytest.fixture(scope="module")
def tokenizer(qwen2_vl_tiny):
    return AutoTokenizer.from_pretrained(qwen2_vl_tiny)


def answers(engine: Engine, tokenizer, params: list[Sampling]) -> list[tuple[str, str]]:
    """Runs the requests together; each one's text (EOS dropped) and finish reason."""
    for i, p in enumerate(params):
        engine.add_request(f"r{i}", PromptInput.text(range(100, 112)), p)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(params))}
    reasons = {}
    for out in engine.run_until_idle():
        tokens[out.request_id] += out.new_token_ids
        if out.finished:
            reasons[out.request_id] = out.finish_reason
    result = []
    for i in range(len(params)):
        ids = tokens[f"r{i}"]
        if reasons[f"r{i}"] == "stop":
            ids = ids[:-1]
        result.append((tokenizer.decode(ids), reasons[f"r{i}"]))
    return result


def json_schema(schema: dict) -> StructuredOutput:
    return StructuredOutput("json_schema", json.dumps(schema))


def test_every_sample_follows_its_grammar_in_one_batch(engine, tokenizer):
    """Three samples per constraint, at temperature 1, batched with an unconstrained
    request: each ends on EOS with text its grammar accepts. (json_object is the schema
    path with `{"type": "object"}`; random weights write keys of any length, so it is
    checked by its mask below, not by a finished answer.)"""
    constraints = {
        "schema": json_schema(SCHEMA),
        "regex": StructuredOutput("regex", r"\d{3}-\d{4}"),
        "choice": StructuredOutput("choice", json.dumps(["yes", "no", 'a "quoted" maybe'])),
    }
    params = [
        Sampling(max_tokens=120, temperature=1.0, seed=seed, structured=c)
        for c in constraints.values()
        for seed in range(3)
    ]
    free = Sampling(max_tokens=20, temperature=1.0, seed=7)
    results = answers(engine, tokenizer, [*params, free])
    for (text, reason), p in zip(results, params, strict=False):
        assert reason == "stop", (p.structured, text)
        kind = p.structured.kind
        if kind == "json_schema":
            assert valid(json.loads(text)), text
        elif kind == "regex":
            assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", text), text
        else:
            assert text in ("yes", "no", 'a "quoted" maybe'), text
    # the unconstrained neighbour samples as it does alone (its own seed, no mask)
    assert results[-1] == answers(engine, tokenizer, [free])[0]


@pytest.mark.parametrize(
    "edge",
    [
        dict(temperature=1e-40),
        dict(temperature=1e-300, top_p=0.5),
        dict(temperature=1.0, top_p=1e-300),
        dict(temperature=2.0, min_p=1.0),
    ],
)
def test_a_vanishing_temperature_or_top_p_under_a_grammar_is_its_greedy_answer(
    engine, tokenizer, edge
):
    """Such a request picked token 0 at every step, which the grammar forbids: the server
    logged 'left its grammar' and aborted it. It is the greedy answer, ended by EOS."""
    phone = StructuredOutput("regex", r"\d{3}-\d{4}")
    [greedy] = answers(
        engine, tokenizer, [Sampling(max_tokens=20, temperature=0.0, structured=phone)]
    )
    [edged] = answers(
        engine, tokenizer, [Sampling(max_tokens=20, seed=1, structured=phone, **edge)]
    )
    assert edged == greedy and greedy[1] == "stop"
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", greedy[0]), greedy


def test_unconstrained_random_weights_are_not_json(engine, tokenizer):
    """What proves the constraint: the same model without it writes no JSON."""
    for text, _ in answers(engine, tokenizer, [Sampling(max_tokens=30, temperature=1.0, seed=s)
                                                for s in range(3)]):  # fmt: skip
        with pytest.raises(json.JSONDecodeError):
            json.loads(text)


def test_a_bad_constraint_is_refused_at_admission_and_costs_nothing(engine):
    pages = engine.kv_cache.pool.num_free
    for bad in (StructuredOutput("regex", "[a-"), StructuredOutput("json_schema", "{not json"),
                StructuredOutput("json_schema", '{"type": "objectx"}')):  # fmt: skip
        assert grammar_error(bad)
        with pytest.raises(ValueError, match="constraint"):
            engine.add_request("bad", PromptInput.text(range(100, 110)), Sampling(structured=bad))
        assert "bad" not in engine.requests
    assert engine.kv_cache.pool.num_free == pages


def test_min_tokens_cannot_push_a_grammar_past_its_end(engine, tokenizer):
    """min_tokens masks EOS; under a grammar that has ended, EOS is all that is left, so
    the grammar wins and the answer stays valid."""
    choice = StructuredOutput("choice", json.dumps(["yes", "no"]))
    [(text, reason)] = answers(
        engine, tokenizer, [Sampling(max_tokens=10, min_tokens=8, structured=choice)]
    )
    assert text in ("yes", "no") and reason == "stop"


def test_the_mask_keeps_exactly_the_allowed_tokens(qwen2_vl_tiny):
    """The bitmask as applied: the first token of a JSON object may only open it."""
    config = json.loads((qwen2_vl_tiny / "config.json").read_text())
    vocab = config.get("text_config", config).get("vocab_size", config.get("vocab_size"))
    grammars = Grammars(qwen2_vl_tiny, vocab, eos_token_ids=[vocab - 12])
    matcher = grammars.matcher(StructuredOutput("json_object"))
    tokenizer = AutoTokenizer.from_pretrained(qwen2_vl_tiny)
    bitmask = new_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.zeros(2, vocab)
    apply_bitmask(logits, [1], bitmask)
    allowed = torch.isfinite(logits[1]).nonzero().flatten().tolist()
    assert allowed and all(tokenizer.decode([t]).lstrip().startswith("{") for t in allowed)
    assert torch.isfinite(logits[0]).all()  # a row without a grammar is untouched
    greedy = Sampler()(torch.randn(1, vocab), [SamplingRow(Sampling(temperature=0), None, (),
                                                           grammar=matcher)])  # fmt: skip
    assert greedy.item() in allowed
