"""Data parallelism on the multi-turn image chat, over HTTP against real `iris serve`s.

`bench.multiturn_image`'s conversation (8 rounds, one new image per round, answers kept)
against two servers on the same checkpoint:

- `default`: one scheduler (`--data-parallel-size 1`);
- `data-parallel 2`: `--data-parallel-size 2`, two schedulers, each with its own KV,
  prefix and embedding caches, tokenizer worker i feeding replica i mod 2.

A conversation's later rounds re-send its earlier images, so the server's image router
must keep it on the replica holding them: one image encoded per round, all of a
conversation's on one replica, as with one scheduler. Per round and variant: TTFT
(client and server), images encoded and which replica encoded them (per-replica deltas of
`iris_mm_images_encoded_total{replica="r"}`), ViT time and cached prompt tokens. After
the conversation, the data-parallel server gets 8 independent single-image
conversations (distinct images, one at a time), to show how new conversations spread
over the replicas.

On a CPU both replicas share the same cores (the launcher gives each replica its share
of the scheduler threads), so this is a check of routing and per-replica caches, not of
speed; on GPUs each replica would have its own device.

    python -m bench.data_parallel [--size tiny|small] [--rounds 8] [--quick]
                                  [--model DIR] [--interleave] [--out DIR]
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import httpx

from bench.images import image_part
from bench.multiturn_image import SYSTEM, Setting, conversation_round, plot, setting
from bench.results_io import markdown_table, write_result
from bench.scenario import (
    add_arguments,
    load_average,
    measured_chat,
    order_note,
    run_variants,
    setup_sentences,
    target,
    warm_up,
)
from bench.server_process import IrisServer, Metrics, chat_body
from iris_serve.server.launcher import usable_cores

VARIANTS: list[tuple[str, list[str]]] = [
    ("default", []),
    ("data-parallel 2", ["--data-parallel-size", "2"]),
]
INDEPENDENT = 8  # single-image conversations sent to the data-parallel server afterwards
INDEPENDENT_SEED = 700  # their image seeds: INDEPENDENT_SEED + i, none seen before
ENCODED = "iris_mm_images_encoded_total"

Rows = dict[str, list[dict[str, Any]]]


def per_replica(metrics: Metrics, name: str = ENCODED) -> list[float]:
    """`name` per replica: `name{replica="r"}` for r = 0, 1, ...; one scheduler's
    unlabelled sample as replica 0."""
    values: list[float] = []
    while (key := f'{name}{{replica="{len(values)}"}}') in metrics:
        values.append(metrics[key])
    return values or [metrics.get(name, 0.0)]


def measured_on_replicas(
    client: httpx.Client, server: IrisServer, body: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    """`measured_chat`, plus which replica encoded the request's images: per-replica
    deltas of the images encoded (its scrape after the request has its counts in)."""
    before = per_replica(server.metrics())
    text, cost = measured_chat(client, server, body)
    totals = per_replica(server.metrics())
    deltas = [int(a - b) for a, b in zip(totals, before, strict=True)]
    where = ",".join(str(r) for r, d in enumerate(deltas) if d) or "-"
    return text, {**cost, "by_replica": deltas, "replica": where, "totals": totals}


def requests(run: Setting, name: str, server: IrisServer) -> Iterator[dict[str, Any]]:
    """Warm-up, then the conversation's rounds (`kind` "round"); on a data-parallel
    server, then the independent conversations (`kind` "independent")."""
    with httpx.Client(timeout=600) as client:
        model = server.model_name()

        def body(messages: list[dict[str, Any]]) -> dict[str, Any]:
            return chat_body(model, messages, run.max_tokens, run.max_pixels)

        warm_up(client, server, body([]))
        messages: list[dict[str, Any]] = [{"role": "system", "content": SYSTEM}]
        for round_ in range(1, run.rounds + 1):
            size = run.sizes[(round_ - 1) % len(run.sizes)]
            messages = conversation_round(messages, round_, size)
            text, cost = measured_on_replicas(client, server, body(messages))
            image = f"{size[0]}x{size[1]}"
            yield {"kind": "round", "variant": name, "round": round_, "image": image, **cost}
            messages = [*messages, {"role": "assistant", "content": text}]
        if len(per_replica(server.metrics())) == 1:
            return
        for i in range(INDEPENDENT):
            size = run.sizes[i % len(run.sizes)]
            part = image_part(*size, seed=INDEPENDENT_SEED + i)
            single = [{"role": "user", "content": [part, {"type": "text", "text": "What is it?"}]}]
            _, cost = measured_on_replicas(client, server, body(single))
            image = f"{size[0]}x{size[1]}"
            yield {
                "kind": "independent",
                "variant": name,
                "conversation": i + 1,
                "image": image,
                **cost,
            }


def split(results: Rows, kind: str) -> Rows:
    return {name: [r for r in rows if r["kind"] == kind] for name, rows in results.items()}


def replica_counts(values: list[float] | list[int]) -> str:
    return ", ".join(f"r{r}: {int(v)}" for r, v in enumerate(values))


def summary(rounds: Rows) -> list[list[object]]:
    base = sum(r["ttft_ms"] for r in rounds["default"][1:])
    table: list[list[object]] = []
    for name, rows in rounds.items():
        later = rows[1:]  # rounds 2..N: what the caches can save
        ttft = sum(r["ttft_ms"] for r in later)
        prompt = sum(r["prompt_tokens"] for r in later)
        cached = sum(r["cached_tokens"] for r in later)
        encoded = sum(r["encoded"] for r in rows)
        conversation = [sum(col) for col in zip(*(r["by_replica"] for r in rows), strict=True)]
        table.append([
            name, sum(r["ttft_ms"] for r in rows) / 1e3, ttft / 1e3,
            ttft / base if base else float("nan"), encoded,
            sum(r["vit_ms"] for r in rows) / 1e3,
            sum(r["vit_ms"] for r in rows) / max(1, encoded),
            f"{cached}/{prompt} ({cached / prompt:.0%})" if prompt else "0/0",
            replica_counts(conversation), replica_counts(rows[-1]["totals"]),
        ])  # fmt: skip
    return table


COLUMNS = [  # (row key, header) of the per-round table
    ("round", "round"),
    ("image", "image"),
    ("variant", "variant"),
    ("prompt_tokens", "prompt tok"),
    ("cached_tokens", "cached tok"),
    ("encoded", "images encoded"),
    ("replica", "encoded on replica"),
    ("vit_ms", "ViT ms"),
    ("ttft_ms", "TTFT ms"),
    ("ratio", "TTFT ÷ default"),
    ("server_ttft_ms", "server TTFT ms"),
]
INDEPENDENT_COLUMNS = [
    ("conversation", "conversation"),
    ("image", "image"),
    ("encoded", "images encoded"),
    ("replica", "encoded on replica"),
    ("ttft_ms", "TTFT ms"),
]


def warnings(rounds: Rows) -> list[str]:
    """What would make the comparison wrong: other prompts, more than one image encoded
    in a round, a conversation encoded on several replicas."""
    notes = []
    prompts = {name: [r["prompt_tokens"] for r in rows] for name, rows in rounds.items()}
    if len({tuple(p) for p in prompts.values()}) > 1:
        notes.append(f"- WARNING: the variants' prompt lengths differ: {prompts}")
    for name, rows in rounds.items():
        encoded = [r["encoded"] for r in rows]
        if any(e != 1 for e in encoded):
            notes.append(f"- WARNING: {name} did not encode one image per round: {encoded}")
        if len({r["replica"] for r in rows}) > 1:
            notes.append(f"- WARNING: {name}'s conversation moved between replicas")
    return notes


def report(
    run: Setting, model: str, results: Rows, png: str, load: tuple[float, float], how_run: str
) -> str:
    rounds, independent = split(results, "round"), split(results, "independent")
    base = {r["round"]: r["ttft_ms"] for r in rounds["default"]}
    order = [name for name, _ in VARIANTS]
    per_round = sorted(
        ({**r, "ratio": r["ttft_ms"] / base[r["round"]]} for rows in rounds.values() for r in rows),
        key=lambda r: (r["round"], order.index(r["variant"])),
    )
    summary_header = [
        "variant", "TTFT all rounds s", f"TTFT rounds 2-{run.rounds} s", "÷ default",
        "images encoded", "ViT s", "ViT ms / image", "cached / prompt tok (2+)",
        "conversation's images per replica", "images per replica at the end (with warm-up)",
    ]  # fmt: skip
    spread = []
    for name, rows in independent.items():
        if not rows:
            continue
        per = [sum(col) for col in zip(*(r["by_replica"] for r in rows), strict=True)]
        spread += [
            f"## {len(rows)} independent conversations on `{name}`",
            "",
            "Each a new single-image conversation (distinct images, none seen before), sent "
            "one at a time after the multi-turn conversation; the router picks a replica "
            f"from the first image's hash. Images encoded per replica: {replica_counts(per)}.",
            "",
            markdown_table(
                [t for _, t in INDEPENDENT_COLUMNS], [[r[k] for k, _ in INDEPENDENT_COLUMNS] for r in rows]
            ),
            "",
        ]  # fmt: skip
    cores = usable_cores()  # the launcher's default scheduler threads
    pixels = "processor default" if run.max_pixels is None else f"max_pixels={run.max_pixels}"
    return "\n".join([
        f"{model[0].upper()}{model[1:]}; `bench.multiturn_image`'s conversation: "
        f"{run.rounds} rounds, one new JPEG per round (cycling "
        f"{', '.join(f'{w}x{h}' for w, h in run.sizes)}; {pixels}); answers of "
        f"{run.max_tokens} tokens (greedy, ignore_eos) kept in the history. `default` is one "
        "scheduler, `data-parallel 2` is `--data-parallel-size 2`. " + how_run + "; "
        + setup_sentences(run.flags, load),
        "",
        "This machine has no GPU: the two replicas share the same CPU cores (the launcher "
        f"splits the scheduler threads between them: {max(1, cores // 2)} torch thread(s) "
        f"per replica here, {cores} for the default), so TTFT here is not a speed claim, "
        "and a lone conversation on one replica runs on its share of the cores. What the "
        "figure shows is routing and per-replica caches: one image encoded per round, "
        "every turn of the conversation on one replica, its earlier images' embeddings "
        "and KV reused there. On GPUs each replica would have its own device.",
        "",
        "## Summary",
        "",
        markdown_table(summary_header, summary(rounds)),
        "",
        f"![TTFT per round]({png})",
        "",
        "## Per round",
        "",
        markdown_table([t for _, t in COLUMNS], [[r[k] for k, _ in COLUMNS] for r in per_round]),
        "",
        *spread,
        "Columns: TTFT ms = client, request sent → first content chunk (streaming); server "
        "TTFT ms = `iris_time_to_first_token_seconds` (arrival → first token); images "
        "encoded / ViT ms = `iris_mm_images_encoded_total` / `iris_mm_encoder_seconds_sum` "
        "deltas (summed over replicas); encoded on replica = the replica(s) whose "
        '`iris_mm_images_encoded_total{replica="r"}` grew (0 for one scheduler); images per '
        "replica: those deltas summed over the conversation, and each replica's total after "
        "it (the warm-up's images included); cached tok = `usage.prompt_tokens_details."
        "cached_tokens`.",
        *warnings(rounds),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=None, help="default 8 (2 with --quick)")
    add_arguments(parser)
    args = parser.parse_args()
    run = setting(args.size, args.rounds, args.quick)
    out = target("data_parallel", args)
    load_before = load_average()
    results = run_variants(
        out.model_dir, VARIANTS, lambda name, server: requests(run, name, server),
        flags=run.flags, quick=args.quick, interleave=args.interleave,
    )  # fmt: skip
    load = (load_before, load_average())
    plot(
        split(results, "round"),
        out.out_dir / out.png,
        f"Data parallelism, multi-turn ({out.label})",
    )
    body = report(run, out.description, results, out.png, load, order_note(args.interleave))
    write_result(out.name, f"Data parallelism, multi-turn chat ({out.label})", body, out.out_dir)


if __name__ == "__main__":
    main()
