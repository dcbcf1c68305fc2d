"""The user-facing commands run: `iris generate` and the benchmarks without a test file
of their own (`--quick`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from iris_serve.scheduler.cpu_kernels.build import cache_dir as kernel_cache_dir
from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.bench_smoke import check_provenance, markdown_tables, run_bench
from tests.reference import chat_prompt, make_image, reference_tokens

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        "IRIS_CACHE_DIR": str(tmp_path / "cache"),
        "IRIS_KERNEL_CACHE_DIR": str(kernel_cache_dir()),  # built once per machine
        "HF_HUB_OFFLINE": "1",
        "PATH": "/usr/bin:/bin",
    }
    result = subprocess.run(
        args, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout, check=False
    )
    assert result.returncode == 0, f"{args} failed:\n{result.stdout}\n{result.stderr}"
    return result


def test_iris_generate_with_an_image(qwen2_vl_tiny, tmp_path):
    image = tmp_path / "picture.png"
    make_image(100, 80, seed=1).save(image)
    result = run(
        [
            sys.executable,
            "-m",
            "iris_serve.launch.cli",
            "generate",
            str(qwen2_vl_tiny),
            "--image",
            str(image),
            "--max-tokens",
            "5",
        ],
        tmp_path,
    )
    builder = PromptBuilder(qwen2_vl_tiny)
    prompt = chat_prompt(builder, "Describe the picture.", [Image.open(image)])  # the default
    expected = reference_tokens(qwen2_vl_tiny, prompt, 5)
    text = builder.tokenizer.decode(expected, skip_special_tokens=True)
    summary = f"[{len(prompt.token_ids)} prompt tokens, 1 images, {len(expected)} output tokens"
    assert result.stdout.startswith(f"{text}\n{summary} in "), result.stdout


def test_iris_generate_names_a_missing_or_broken_image(tmp_path):
    broken = tmp_path / "broken.png"
    broken.write_text("not a picture")
    for image, says in ((tmp_path / "missing.png", "No such file"), (broken, "cannot identify")):
        command = [sys.executable, "-m", "iris_serve.launch.cli", "generate", "--image", str(image)]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and f"--image {image}: " in done.stderr, done.stderr
        assert says in done.stderr and "Traceback" not in done.stderr


def test_roofline_quick_reports_every_stage_against_the_device(tmp_path):
    out = tmp_path / "results"
    run_bench("bench.roofline", "--quick", "--out", str(out), cache_dir=tmp_path / "cache",
              timeout=600)  # fmt: skip
    text = (out / "roofline_cpu_tiny_quick.md").read_text()
    assert (out / "roofline_cpu_tiny_quick.png").stat().st_size > 0
    (header, rows), (agent_header, [turn]) = markdown_tables(text)
    assert "read bandwidth" in text and "in bfloat16" in text and "in float32" in text
    assert header[-1] == "fraction of roofline"
    assert [row[0].split(",")[0].split(" ")[0] for row in rows] == [
        "decode", "decode", "prefill", "ViT", "ViT"
    ]  # fmt: skip
    for row in rows:
        measured, roofline, fraction = float(row[1]), float(row[2]), float(row[4])
        assert measured > 0 and roofline > 0
        assert abs(fraction - roofline / measured) < 0.01 * fraction + 1e-3
    # the returning turn (history cached, a new screenshot): the server's clocks
    split = dict(zip(agent_header, map(float, turn), strict=True))
    assert split["new tokens"] > 0 and split["tower ms"] > 0 and split["prefill steps ms"] > 0
    assert split["prefill steps ms"] <= split["server prefill ms"] <= split["server TTFT ms"]
    assert split["server TTFT ms"] <= split["TTFT ms"]
    parts = split["TTFT ms"] - split["tower ms"] - split["prefill steps ms"]
    assert abs(split["other ms"] - parts) < 0.01 * split["TTFT ms"] + 0.01


def test_tensor_parallel_quick_compares_one_and_two_ranks(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.tensor_parallel", "--quick", "--out", str(out), cache_dir=tmp_path / "cache",
        timeout=300,
    )  # fmt: skip
    text = (out / "tensor_parallel_tiny_quick.md").read_text()
    check_provenance(text)
    [(header, rows)] = markdown_tables(text)
    assert header == ["workload", "metric", "TP=1", "TP=2", "TP=2 / TP=1"]
    cells = {(row[0], row[1]): row for row in rows}
    for workload, metric in [("decode", "out tok/s"), ("prefill", "prompt tok/s")]:
        _, _, one, two, ratio = cells[workload, metric]
        assert float(one) > 0 and float(two) > 0 and float(ratio) > 0
    for workload in ("decode", "prefill", "images"):
        assert cells[workload, "RankStep bytes mean / max"][3] != "-"
    assert "TP=2 matched TP=1 on all" in text


def test_server_startup_quick_times_each_variant(tmp_path):
    out = tmp_path / "results"
    # (`--before-tree` serves another checkout as serve_load's does: test_bench_source_tree)
    run_bench("bench.server_startup", "--quick", "--out", str(out), cache_dir=tmp_path,
              timeout=400)  # fmt: skip
    text = (out / "server_startup_tiny_quick.md").read_text()
    check_provenance(text)
    [(header, rows)] = markdown_tables(text)
    variants = [  # --quick: the baseline and the stop with a stream in flight
        "2 tokenizer workers (default)",
        "a stream in flight at the stop (--shutdown-timeout 1)",
    ]
    assert [row[0] for row in rows] == variants
    cells = [dict(zip(header, row, strict=True)) for row in rows]
    assert cells[0]["÷ default"] == "1"
    assert all(float(c["up s"]) > 0 and float(c["CPU s (start and stop)"]) > 0 for c in cells)
    assert all(float(c["stop s"]) > 0 for c in cells)
    assert all(float(c["stop s"]) >= 1 for c in cells if "in flight" in c["variant"])  # grace


def test_soak_quick_serves_every_kind_without_an_unexpected_error(tmp_path):
    """A few seconds of the soak's whole mix on one server: every kind answered as a client
    expects, the owners' counts back to zero, a clean stop with nothing left in /dev/shm."""
    from bench.soak_traffic import KINDS

    out = tmp_path / "results"
    run_bench("bench.soak", "--quick", "--out", str(out), cache_dir=tmp_path / "cache",
              timeout=600)  # fmt: skip
    text = (out / "soak_tiny_quick.md").read_text()
    (_, verdict), (header, windows) = markdown_tables(text)[:2]
    checks = {row[1]: row[2] for row in verdict}
    assert checks["unexpected errors"] == "0", text
    assert checks["owners' counts zero when idle"] == "yes"
    assert checks["exit status; /dev/shm segments left"] == "0; 0"
    assert len(windows) >= 2 and header[2] == "errors"
    by_kind = dict(pair.rsplit(" ", 1) for pair in text.split("Requests by kind: ")[1]
                   .splitlines()[0].split(", "))  # fmt: skip
    assert set(by_kind) == set(KINDS) and all(int(n) >= 1 for n in by_kind.values())
