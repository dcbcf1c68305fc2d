"""The served-load benchmark runs end to end (built-in client, no peer), and the vLLM
client's install script parses and pins what it installs."""

from __future__ import annotations

import json
import re
import subprocess

import pytest

from bench.drop_fields_proxy import drop_fields
from bench.load_client import RequestResult, summarize
from tests.bench_smoke import REPO, check_provenance, run_bench

INSTALL_SCRIPT = REPO / "bench" / "install_vllm_client.sh"


def test_serve_load_quick_builtin_writes_its_results(tmp_path):
    out = tmp_path / "results"
    run_bench(
        "bench.serve_load", "--quick", "--client", "builtin", "--no-peer", "--threads", "1",
        "--out", str(out), cache_dir=tmp_path, timeout=300,
    )  # fmt: skip

    table = (out / "serve_load_tiny_builtin_threads1_quick.md").read_text()
    check_provenance(table)
    for header in ("## Served", "## Compute bound"):
        assert header in table
    for workload in ("image", "text"):
        assert re.search(rf"\| {workload} \| iris \| [\d.]+ \| 4/4 \|", table), table
    assert (out / "serve_load_tiny_builtin_threads1_quick.png").stat().st_size > 10_000

    raw = json.loads((out / "serve_load_tiny_builtin_threads1_quick.json").read_text())
    runs = {run["workload"]: run for run in raw["runs"]}
    assert set(runs) == {"image", "text"}
    for run in runs.values():
        metrics = run["metrics"]
        assert metrics["completed"] == 4 and metrics["failed"] == 0
        assert metrics["request_throughput"] > 0 and metrics["mean_ttft_ms"] > 0
        assert all(1 <= n <= 8 for n in metrics["output_lens"])
    # The image workload's prompts hold the image's tokens (448x252: 16 x 9 merged patches).
    image_prompt = sum(runs["image"]["metrics"]["input_lens"]) / 4
    text_prompt = sum(runs["text"]["metrics"]["input_lens"]) / 4
    assert image_prompt - text_prompt == pytest.approx(144, abs=8)
    bounds = {bound["workload"]: bound for bound in raw["bounds"]}
    assert set(bounds) == {"image", "text"}
    assert all(bound["request_throughput"] > 0 for bound in bounds.values())


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
