"""The served-load benchmark runs end to end (built-in client, a named variant beside
`iris`, the compute bound, the video workloads and a worker's video decoding), its summary
says who is ahead, and the vLLM client's install script parses and pins what it
installs."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from bench.drop_fields_proxy import drop_fields
from bench.load_client import RequestResult, summarize
from bench.serve_load import parse_before_tree, parse_model_variant, parse_variant
from bench.serve_load_report import Run, summary_table
from tests.bench_smoke import REPO, check_provenance, markdown_tables, run_bench

INSTALL_SCRIPT = REPO / "bench" / "install_vllm_client.sh"


WORKLOADS = ("image", "text", "video", "clips", "gaps")


def test_serve_load_quick_compares_a_named_variant_with_iris(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.serve_load", "--quick", "--threads", "1", "--variant",
        "paced=OMP_WAIT_POLICY=PASSIVE --max-itl-stretch 3", "--workloads", ",".join(WORKLOADS),
        "--out", str(out), cache_dir=tmp_path, timeout=420,
    )  # fmt: skip
    text = (out / "serve_load_tiny_quick.md").read_text()
    check_provenance(text)
    tables = markdown_tables(text)
    (header, summary), (_, servers), (runs_header, runs), video, clips, decoding, gaps, bound = (
        tables
    )
    assert header == ["workload", "metric", "iris", "paced", "iris ahead of paced"]
    assert list(dict.fromkeys(row[0] for row in summary)) == list(WORKLOADS)
    assert all(float(row[-1]) > 0 for row in summary), summary
    assert "OMP_WAIT_POLICY=PASSIVE iris serve MODEL_DIR" in servers[1][1]
    weights = r"[\d.]+ \w?i?B \(1\.00x\): onednn method"  # the start-up line's
    assert all(re.fullmatch(weights, row[3]) for row in servers), servers
    assert (
        servers[1][1].endswith("--max-itl-stretch 3`") and "--scheduler-threads 1" in servers[1][1]
    )
    ok = runs_header.index("ok")
    sizes = {"image": "4/4", "text": "4/4", "video": "2/2", "clips": "2/2", "gaps": "3/3"}
    assert [(r[0], r[1], r[ok]) for r in runs] == [
        (w, s, sizes[w]) for s in ("iris", "paced") for w in WORKLOADS
    ]
    # The image workload's prompts hold the image's tokens (448x252: 16 x 9 merged patches).
    prompt = {r[0]: float(r[runs_header.index("in tok/req")]) for r in runs if r[1] == "iris"}
    assert prompt["image"] - prompt["text"] == pytest.approx(144, abs=8)
    bound_header, bounds = bound
    assert [row[0] for row in bounds] == ["image", "text"]
    assert all(float(row[bound_header.index("bound req/s")]) > 0 for row in bounds)
    raw = json.loads((out / "serve_load_tiny_quick.json").read_text())
    assert {(r["server"], r["workload"]) for r in raw["runs"]} == {
        (s, w) for s in ("iris", "paced") for w in WORKLOADS
    }
    check_video_tables(video, clips, decoding)
    gaps_header, gaps_rows = gaps
    assert [row[0] for row in gaps_rows] == ["iris", "paced"]
    largest = {row[0]: float(row[gaps_header.index("max ms")]) for row in gaps_rows}
    gap_rows = {row[1]: row for row in summary if row[0] == "gaps"}
    assert float(gap_rows["largest gap while images encode ms"][2]) == largest["iris"]  # one round
    assert all(float(gap_rows[m][2]) > 0 for m in gap_rows), gap_rows


def check_video_tables(video, clips, decoding) -> None:
    """The second question about a clip re-sends it and Iris encodes none of its temporal
    patches again (2 s at 8 fps, sampled at 2 fps: 4 frames, 2 patches); each overlapping
    clip is a new video; the decoding table has a row per video workload."""
    header, rows = video
    assert header[:3] == ["question", "server", "run"]
    encoded = header.index("Iris: images encoded")
    by = {(row[0], row[1]): row for row in rows}
    for server in ("iris", "paced"):
        assert by["1", server][encoded] == "2" and by["2", server][encoded] == "0"
        assert int(by["2", server][header.index("cached tok")]) > 0
    header, rows = clips
    assert [(row[0], row[1]) for row in rows] == [
        (clip, server) for clip in ("1 (0-2 s)", "2 (1-3 s)") for server in ("iris", "paced")
    ]
    assert all(row[header.index("Iris: images encoded")] == "2" for row in rows)
    header, rows = decoding
    assert [row[0] for row in rows] == ["video", "clips"]
    assert all(row[header.index("sampled")] == "4" for row in rows)
    assert all(float(row[header.index("× real time")]) > 0 for row in rows)


def test_a_variant_names_its_flags_and_its_environment():
    assert parse_variant("paced=OMP_WAIT_POLICY=PASSIVE A_B=1 --max-itl-stretch 3") == (
        "paced", ["--max-itl-stretch", "3"], {"OMP_WAIT_POLICY": "PASSIVE", "A_B": "1"}
    )  # fmt: skip
    assert parse_variant("inline=--mm-encoder-inline") == ("inline", ["--mm-encoder-inline"], {})
    for bad in ("no-equals", "iris=--x", "before=--x", "a b=--x"):
        with pytest.raises(SystemExit):
            parse_variant(bad)


def test_the_summary_says_how_far_the_first_server_is_ahead():
    runs = [
        Run("iris", "image", 0, 1, {"request_throughput": 2.0, "mean_ttft_ms": 100.0}),
        Run("iris", "image", 1, 2, {"request_throughput": 4.0, "mean_ttft_ms": 300.0}),
        Run("other", "image", 0, 1, {"request_throughput": 1.5, "mean_ttft_ms": 400.0}),
        Run("other", "image", 1, 2, error="failed"),
    ]
    [(header, rows)] = markdown_tables(summary_table(["iris", "other"], runs))
    assert header[-1] == "iris ahead of other"
    cells = {row[1]: row for row in rows}
    assert cells["req/s"][2:] == ["3", "1.5", "2"]  # means over the rounds each completed
    assert cells["mean TTFT ms"][2:] == ["200", "400", "2"]  # a latency: theirs / ours
    assert cells["mean TPOT ms"][2:] == ["–", "–", "–"]


def test_summarize_follows_vllm_definitions():
    results = [
        RequestResult(ok=True, ttft=0.1, latency=0.4, itl=[0.1, 0.2], output_tokens=3),
        RequestResult(ok=True, ttft=0.3, latency=0.3, itl=[], output_tokens=1),
        RequestResult(ok=False, error="HTTP 500"),
    ]
    metrics = summarize(results, duration=2.0)
    assert metrics["completed"] == 2 and metrics["failed"] == 1
    assert metrics["request_throughput"] == 1.0
    assert metrics["output_throughput"] == 2.0
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    assert metrics["mean_tpot_ms"] == pytest.approx(150.0)  # (0.4 - 0.1) / (3 - 1)
    assert metrics["mean_itl_ms"] == pytest.approx(150.0)


def test_the_proxy_drops_only_the_named_fields():
    body = json.dumps({"model": "m", "ignore_eos": True, "stream": True}).encode()
    assert json.loads(drop_fields(body, frozenset({"ignore_eos"}))) == {
        "model": "m",
        "stream": True,
    }
    assert drop_fields(b"not json", frozenset({"ignore_eos"})) == b"not json"
    assert drop_fields(b"[1, 2]", frozenset({"ignore_eos"})) == b"[1, 2]"


def test_install_script_parses_and_pins_every_package():
    subprocess.run(["bash", "-n", str(INSTALL_SCRIPT)], check=True)
    text = INSTALL_SCRIPT.read_text()
    assert re.search(r"^VLLM_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    assert re.search(r"^TORCH_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    # torch (CPU) is installed before vllm, and vllm without its dependencies.
    assert text.index('"torch==$TORCH_VERSION"') < text.index('"vllm==$VLLM_VERSION"')
    assert re.search(r"install -q --no-deps \"vllm==\$VLLM_VERSION\"", text)
    packages = []
    for block in re.findall(r"^(?:CLIENT|PEER)_DEPS=\((.*?)\)$", text, re.MULTILINE | re.DOTALL):
        packages += block.split()
    assert len(packages) > 40
    unpinned = [p for p in packages if not re.fullmatch(r"[A-Za-z0-9_.\-]+==[\w.]+", p)]
    assert not unpinned, unpinned
    names = {p.split("==")[0].lower() for p in packages}
    assert not names & {"torch", "vllm", "triton", "flashinfer-python"}
    assert not any(name.startswith("nvidia") for name in names)


def test_before_trees_are_named_and_repeatable(tmp_path):
    assert parse_before_tree(str(tmp_path)) == ("before", tmp_path.resolve())
    assert parse_before_tree(f"regressed={tmp_path}") == ("regressed", tmp_path.resolve())
    for bad in (f"iris={tmp_path}", f"a b={tmp_path}"):
        with pytest.raises(SystemExit):
            parse_before_tree(bad)


def test_a_model_variant_serves_another_checkpoint_with_its_flags(tmp_path):
    assert parse_model_variant(f"fp8={tmp_path} --dtype bfloat16") == (
        "fp8", tmp_path.resolve(), ["--dtype", "bfloat16"], {}
    )  # fmt: skip
    with pytest.raises(SystemExit):
        parse_model_variant("fp8=")
