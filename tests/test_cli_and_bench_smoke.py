"""The user-facing commands run: `iris generate` and the offline engine benchmark."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from PIL import Image

from iris_serve.tokenizer_worker.prompt import PromptBuilder
from tests.bench_smoke import check_provenance, markdown_tables, run_bench
from tests.reference import chat_prompt, make_image, reference_tokens

REPO = Path(__file__).resolve().parents[1]


def run(args: list[str], tmp_path: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {
        "IRIS_CACHE_DIR": str(tmp_path / "cache"),
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


def test_engine_benchmark_writes_its_table(tmp_path):
    run(
        [
            sys.executable,
            "-m",
            "bench.engine_offline",
            "--sizes",
            "tiny",
            "--quick",
            "--threads",
            "1",
            "--out",
            str(tmp_path / "results"),
        ],
        tmp_path,
    )
    table = (tmp_path / "results" / "engine_offline_quick.md").read_text()
    for metric in ("prefill tok/s", "decode tok/s", "ViT img/s"):
        assert metric in table
    assert "- machine:" in table and "- command:" in table and "- commit:" in table


def test_decode_profile_quick_accounts_for_the_step(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.decode_profile",
        "--quick",
        "--threads",
        "1",
        "--out",
        str(out),
        cache_dir=tmp_path / "cache",
        timeout=600,
    )
    [(header, rows)] = markdown_tables((out / "decode_profile_tiny_quick.md").read_text())
    assert [row[:2] for row in rows] == [["64", "1"], ["64", "2"]]
    for row in rows:
        ms = dict(zip(header, (float(cell) for cell in row), strict=True))
        # every category found its ops (a renamed aten op would leave one at 0); the
        # K/V copies are the ones the in-place attention avoids, so they may be 0
        for name in ("K/V write", "attention kernel", "matmuls"):
            assert ms[f"{name} ms"] > 0, name
        assert ms["K/V copies ms"] >= 0
        assert ms["step ms"] > 0 and ms["attention metadata ms"] > 0 and ms["sampling ms"] > 0


def test_decode_peers_quick_measures_the_served_decode(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.decode_peers", "--quick", "--peers", "iris", "--out", str(out),
        cache_dir=tmp_path / "cache", timeout=600,
    )  # fmt: skip
    [(header, rows)] = markdown_tables((out / "decode_peers_tiny_quick.md").read_text())
    assert header[:3] == ["context", "batch", "Iris median ITL ms"]
    assert [row[:2] for row in rows] == [["128", "2"]]
    assert float(rows[0][2]) > 0 and float(rows[0][4]) > 0  # ITL, TTFT


def test_roofline_quick_reports_every_stage_against_the_device(tmp_path):
    out = tmp_path / "results"
    run_bench("bench.gpu_roofline", "--quick", "--out", str(out), cache_dir=tmp_path / "cache",
              timeout=600)  # fmt: skip
    [(header, rows)] = markdown_tables((out / "roofline_cpu_tiny_quick.md").read_text())
    assert header[-1] == "fraction of roofline"
    assert [row[0].split(",")[0].split(" ")[0] for row in rows] == [
        "decode", "decode", "prefill", "ViT", "ViT"
    ]  # fmt: skip
    for row in rows:
        measured, roofline, fraction = float(row[1]), float(row[2]), float(row[4])
        assert measured > 0 and roofline > 0
        assert abs(fraction - roofline / measured) < 0.01 * fraction + 1e-3


def test_moe_block_quick_times_every_variant(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.moe_block", "--quick", "--threads", "1", "--out", str(out),
        cache_dir=tmp_path, timeout=300,
    )  # fmt: skip
    [(header, rows)] = markdown_tables((out / "moe_block_quick.md").read_text())
    assert [row[0] for row in rows] == ["1", "16"]
    for row in rows:
        cells = dict(zip(header, row, strict=True))
        for variant in ("grouped_mm", "expert loop", "hf eager", "all experts"):
            assert float(cells[f"{variant} ms"]) > 0, variant
        assert 1 <= int(cells["experts hit"]) <= 8


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


def test_pixel_format_quick_compares_the_two_paths(tmp_path):
    """The benchmark checks that both paths give the same rows before timing them."""
    out = tmp_path / "results"
    run_bench("bench.pixel_format", "--quick", "--out", str(out),
              cache_dir=tmp_path / "cache", timeout=600)  # fmt: skip
    text = (out / "pixel_format_quick.md").read_text()
    check_provenance(text)
    [(header, [row])] = markdown_tables(text)
    cells = dict(zip(header, row, strict=True))
    assert float(cells["arena ratio"]) == 8.0  # 24 float32 bytes per pixel against 3


def test_itl_stretch_quick_measures_each_setting_against_the_old_engine(tmp_path):
    out = tmp_path / "results"
    run_bench("bench.itl_stretch", "--quick", "--stretches", "3", "--out", str(out),
              cache_dir=tmp_path / "cache", timeout=600)  # fmt: skip
    text = (out / "itl_stretch_tiny_quick.md").read_text()
    check_provenance(text)
    [(_, summary), (header, rounds)] = markdown_tables(text)
    old = "inline, unpaced (before issue 12)"
    assert [row[:2] for row in summary] == [
        ["stretch 3", "image"], [old, "image"], ["stretch 3", "text"], [old, "text"]
    ]  # fmt: skip
    for row in (row for row in summary if row[0] == old):  # each round ÷ itself
        assert [float(cell) for cell in row[2:4]] == [1.0, 1.0]  # req/s, TTFT
        assert row[4] == "n/a" or float(row[4]) == 1.0  # TPOT: none if every answer is 1 token
    assert {row[header.index("ok")] for row in rounds} == {"2/2"}


def test_penalties_quick_times_every_variant(tmp_path):
    out = tmp_path / "results"
    run_bench("bench.penalties", "--quick", "--out", str(out), cache_dir=tmp_path, timeout=120)
    [(header, rows)] = markdown_tables((out / "penalties_quick.md").read_text())
    [row] = rows
    cells = dict(zip(header, row, strict=True))
    assert all(float(cells[name]) > 0 for name in header[1:]), cells


def test_chunk_attention_quick_times_both_paths(tmp_path):
    """Per layer and end to end, with a prompt long enough for a chunk after history."""
    out = tmp_path / "results"
    run_bench(
        "bench.chunk_attention", "--quick", "--out", str(out), cache_dir=tmp_path, timeout=120
    )
    text = (out / "chunk_attention_tiny_quick.md").read_text()
    check_provenance(text)
    (layer_header, [layer]), (e2e_header, [e2e]) = markdown_tables(text)
    assert float(layer[layer_header.index("masked ms")]) > 0
    assert float(layer[layer_header.index("split ms")]) > 0
    assert int(e2e[e2e_header.index("prompt tokens")]) > 2048  # a second chunk, after history
    assert float(e2e[e2e_header.index("split s")]) > 0


def test_encoder_overlap_quick_traces_both_placements(tmp_path):
    """Beside the steps the tower runs in calls of its own and no step encodes; inline
    it runs inside the steps; each variant's requests all get their tokens."""
    out = tmp_path / "results"
    run_bench(
        "bench.encoder_overlap", "--quick", "--out", str(out), cache_dir=tmp_path, timeout=180
    )
    text = (out / "encoder_overlap_tiny_quick.md").read_text()
    check_provenance(text)
    [(header, rows)] = markdown_tables(text)
    by_variant = {row[0]: dict(zip(header, row, strict=True)) for row in rows}
    assert set(by_variant) == {"beside", "inline"}
    for cells in by_variant.values():
        assert float(cells["req/s"]) > 0 and float(cells["TTFT mean ms"]) > 0
        assert int(cells["tower calls"]) >= 1
    assert float(by_variant["inline"]["tower in steps (of wall)"]) > 0
    assert float(by_variant["beside"]["tower in steps (of wall)"]) < float(
        by_variant["inline"]["tower in steps (of wall)"]
    )


def test_server_startup_quick_times_each_variant(tmp_path):
    out = tmp_path / "results"
    run_bench("bench.server_startup", "--quick", "--out", str(out), cache_dir=tmp_path,
              timeout=300)  # fmt: skip
    text = (out / "server_startup_tiny_quick.md").read_text()
    check_provenance(text)
    [(header, rows)] = markdown_tables(text)
    assert [row[0] for row in rows] == ["2 tokenizer workers (default)", "1 tokenizer worker"]
    cells = [dict(zip(header, row, strict=True)) for row in rows]
    assert cells[0]["÷ default"] == "1"
    assert all(float(c["up s"]) > 0 and float(c["CPU s (start and stop)"]) > 0 for c in cells)
