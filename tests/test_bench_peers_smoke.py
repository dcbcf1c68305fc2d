"""The peer comparison's plumbing, without vLLM or transformers installed (CI has
neither): the run refuses a vLLM peer whose venv is missing, `VllmServer` stops every
process of its group and serves hybrid (Gated DeltaNet) checkpoints in the only dtype vLLM's
CPU kernels for them take, the install script keeps its pins and fixes, and `bench.peers`
measures a second server the way it measures `transformers serve` -- only what a client
sees, through the proxy that says `ignore_eos` the transformers way -- with Iris itself
playing that peer, on every workload."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from bench import peers, serve_load
from bench.drop_fields_proxy import drop_fields
from bench.peers import TransformersServer
from bench.scenario import QUICK_FLAGS
from bench.serve_load import Server
from bench.server_process import IrisServer
from bench.vllm_peer import INSTALL_SCRIPT, STAMP, VllmServer, serve_flags
from iris_serve.tiny_checkpoint.configs import build_config
from tests.bench_smoke import REPO, bench_process, check_provenance, markdown_tables


@pytest.mark.parametrize("stamped", [False, True])
def test_a_vllm_peer_without_its_installed_venv_is_refused(tmp_path: Path, stamped: bool):
    venv = tmp_path / "vllm-cpu"
    if stamped:  # a stamp without the executable is no install either
        venv.mkdir()
        (venv / STAMP).write_text("stamp")
    else:  # an executable without the stamp: the script's fixes are not known to be in
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    out = tmp_path / "results"
    result = bench_process(
        "bench.peers", "--quick", "--client", "builtin", "--peers", "iris,vllm",
        "--vllm-venv", str(venv), "--out", str(out), cache_dir=tmp_path, timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert f"bash {INSTALL_SCRIPT} {venv}" in result.stderr, result.stderr
    assert not out.exists()  # refused before any server started or any file was written


def test_vllm_is_refused_on_the_checkpoint_it_cannot_serve(tmp_path: Path):
    venv = tmp_path / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "vllm").write_text("#!/bin/sh\n")
    (venv / STAMP).write_text("stamp")
    result = bench_process(
        "bench.peers", "--quick", "--size", "tiny", "--client", "builtin", "--peers", "vllm",
        "--vllm-venv", str(venv), "--out", str(tmp_path / "results"), cache_dir=tmp_path,
        timeout=120,
    )  # fmt: skip
    assert result.returncode != 0
    assert "vLLM cannot serve the tiny checkpoint" in result.stderr, result.stderr
    assert "head_dim=16" in result.stderr


FAKE_VLLM = """\
import http.server, json, os, subprocess, sys
port = int(sys.argv[sys.argv.index("--port") + 1])
# An engine-core-like child that ignores SIGTERM: only killing the group ends it.
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
with open(os.environ["FAKE_VLLM_SEEN"], "w") as seen:
    json.dump({"argv": sys.argv[1:], "env": dict(os.environ), "child": child.pid}, seen)
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"{}")
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def test_vllm_server_flags_env_and_nothing_left_behind(tmp_path: Path, qwen2_5_vl_tiny: Path):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "vllm"
    fake.write_text(f"#!{sys.executable}\n{FAKE_VLLM}")
    fake.chmod(0o755)
    seen = tmp_path / "seen.json"
    server = VllmServer(
        qwen2_5_vl_tiny, venv, kv_cache_gib=2, start_timeout=60,
        env={"FAKE_VLLM_SEEN": str(seen), "PYTHONPATH": "/iris/site"},
    )  # fmt: skip
    server.stop_timeout = 3.0
    with server:
        assert httpx.get(f"{server.base_url}/health", timeout=5).status_code == 200
        assert server.process is not None
        started = json.loads(seen.read_text())
    argv = started["argv"]
    assert argv[:2] == ["serve", str(qwen2_5_vl_tiny)]
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--port") + 1] == str(server.port)
    assert argv[argv.index("--dtype") + 1] == "float32"
    assert argv[argv.index("--max-model-len") + 1] == "16384"  # the checkpoint allows 32768
    # vLLM's loader samples the frames; the generated processor must not sample them again
    assert json.loads(argv[argv.index("--mm-processor-kwargs") + 1]) == {"do_sample_frames": False}
    assert started["env"]["VLLM_CPU_KVCACHE_SPACE"] == "2"
    assert started["env"]["HF_HUB_OFFLINE"] == "1"
    assert "PYTHONPATH" not in started["env"]  # Iris's packages must not reach vLLM's venv
    assert server.process.returncode is not None  # the API server was waited for
    child = Path(f"/proc/{started['child']}/stat")  # the SIGTERM-proof child is gone too
    assert not child.exists() or child.read_text().rsplit(")", 1)[1].split()[0] == "Z"


@pytest.mark.parametrize(
    ("arch", "dtype"),
    [("qwen2_5_vl", "float32"), ("qwen3_5", "bfloat16"), ("qwen3_5_moe", "bfloat16")],
)
def test_vllm_serves_hybrid_checkpoints_in_bfloat16(tmp_path: Path, arch: str, dtype: str):
    build_config(arch, "small").save_pretrained(tmp_path)
    flags = serve_flags(tmp_path, "peer")
    assert flags[flags.index("--dtype") + 1] == dtype


@pytest.mark.parametrize(
    ("method", "dtype"), [("awq", "bfloat16"), ("gptq", "bfloat16"), ("fp8", "float32")]
)
def test_vllm_serves_four_bit_checkpoints_in_bfloat16(tmp_path: Path, method: str, dtype: str):
    """vLLM's CPU kernel for AWQ and GPTQ weights takes bfloat16 or float16 only."""
    build_config("qwen2_5_vl", "small").save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method}
    (tmp_path / "config.json").write_text(json.dumps(config))
    flags = serve_flags(tmp_path, "peer")
    assert flags[flags.index("--dtype") + 1] == dtype


def test_install_script_carries_the_recipe():
    script = REPO / INSTALL_SCRIPT
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert re.search(r"^VLLM_VERSION=0\.32\.0$", text, re.MULTILINE)
    assert re.search(r"^TORCH_VERSION=\d+\.\d+\.\d+$", text, re.MULTILINE)
    # CPU torch before vllm-cpu; never a bare torch.
    assert text.index('"torch==$TORCH_VERSION"') < text.index('"vllm-cpu==$VLLM_VERSION"')
    assert not re.search(r"install[^\n]*\btorch\b(?!==)", text)
    # The three fixes, and the check that the CPU platform is picked.
    assert "Version: %s+cpu" in text
    assert "_meta_registrations" in text and "try:  # CPU torch" in text
    assert "uninstall -q -y torchaudio torchcodec" in text
    assert "'Cpu' in type(p.current_platform).__name__" in text
    assert f'STAMP="$VENV/{STAMP}"' in text and text.rstrip().endswith('echo "$VENV"')


def test_the_proxy_says_ignore_eos_the_transformers_way():
    body = json.dumps({"model": "m", "ignore_eos": True, "max_tokens": 16}).encode()
    sent = json.loads(drop_fields(body, frozenset({"ignore_eos"}), min_new_tokens=True))
    assert sent == {"model": "m", "max_tokens": 16, "generation_config": '{"min_new_tokens": 16}'}
    body = json.dumps({"ignore_eos": False, "max_completion_tokens": 8}).encode()
    assert json.loads(drop_fields(body, frozenset({"ignore_eos"}), min_new_tokens=True)) == {
        "max_completion_tokens": 8
    }


class IrisAsAPeer(TransformersServer):
    """`iris serve` measured the way `transformers serve` is: behind the proxy that turns
    `ignore_eos` into `min_new_tokens`, no /metrics counters read."""

    label = "iris serve as a peer"

    @property
    def command(self) -> list[str]:
        return IrisServer.command.fget(self)  # type: ignore[attr-defined]


def test_peers_quick_measures_another_server_as_a_client_sees_it(
    tmp_path: Path, qwen2_5_vl_tiny: Path
):
    workloads = "image,append,window,decode,video,clips"
    args = peers.parse_arguments(
        [
            "--quick",
            "--model",
            str(qwen2_5_vl_tiny),
            "--workloads",
            workloads,
            "--out",
            str(tmp_path),
        ]
    )

    def servers(model_dir: Path, logs: Path) -> list[Server]:
        [iris] = peers.make_servers(args, ["iris"], model_dir, logs)
        other = IrisAsAPeer(model_dir, QUICK_FLAGS, log_path=logs / "other.log")
        return [iris, Server("Other", other, "`iris serve` behind the proxy")]

    runs = serve_load.run(args, servers, "peers", bound=False)
    assert [(r.server, r.workload) for r in runs if r.error] == []

    text = (tmp_path / "peers_quick.md").read_text()
    check_provenance(text)
    (header, summary), *_ = markdown_tables(text)
    assert header == ["workload", "metric", "Iris", "Other", "Iris ahead of Other"]
    assert [row[0] for row in summary] == (
        ["image"] * 5 + ["append"] * 3 + ["window"] * 3 + ["decode 128x2"] * 3 + ["video"] * 6
        + ["clips"] * 3
    )  # fmt: skip
    assert all(float(row[-1]) > 0 for row in summary), summary

    tables = {h[0]: (h, rows) for h, rows in markdown_tables(text)}
    header, window = tables["step"]
    column = {name: header.index(name) for name in header}
    by = {(row[0], row[1]): row for row in window}
    assert set(by) == {(s, p) for s in ("0", "1") for p in ("Iris", "Other")}
    for step in ("0", "1"):
        iris, other = by[step, "Iris"], by[step, "Other"]
        assert iris[column["prompt tok"]] == other[column["prompt tok"]]  # same requests
        assert iris[column["out tok"]] == other[column["out tok"]] == "8"  # ignore_eos, both
        assert other[column["Iris: images encoded"]] == "–"  # no counters read
    assert by["1", "Iris"][column["Iris: images encoded"]] == "1"  # 9 of 10 cached
    header, rows = tables["workload"]
    ok = {(row[0], row[1]): row[header.index("ok")] for row in rows}
    assert ok["image", "Iris"] == ok["image", "Other"] == "4/4"
    assert ok["decode 128x2", "Other"] == "2/2"
    assert ok["video", "Other"] == ok["clips", "Other"] == "2/2"

    header, video = tables["question"]  # the same video, re-sent with the history
    column = {name: header.index(name) for name in header}
    by = {(row[0], row[1]): row for row in video}
    for question in ("1", "2"):
        iris, other = by[question, "Iris"], by[question, "Other"]
        assert iris[column["prompt tok"]] == other[column["prompt tok"]]
        assert iris[column["out tok"]] == other[column["out tok"]] == "8"
        assert other[column["Iris: images encoded"]] == "–"
    assert by["2", "Iris"][column["Iris: images encoded"]] == "0"  # nothing encoded again


def test_a_full_run_plans_as_serve_load_does(qwen2_5_vl_tiny: Path) -> None:
    """Without --quick, `bench.peers` plans the workloads and rounds it is asked for, as
    `bench.serve_load` does (their arguments are shared)."""
    model = ["--model", str(qwen2_5_vl_tiny), "--workloads", "append,window", "--rounds", "2"]
    for parse in (peers.parse_arguments, serve_load.parse_arguments):
        plan = serve_load.make_plan(parse(model))
        assert plan.rounds == 2 and [w.name for w in plan.workloads] == ["append", "window"]


def test_iris_flags_reach_iris_and_its_row_says_so(tmp_path: Path, qwen2_5_vl_tiny: Path):
    args = peers.parse_arguments(
        ["--model", str(qwen2_5_vl_tiny), "--iris-flags", "--dtype bfloat16"]
    )
    [iris] = peers.make_servers(args, ["iris"], qwen2_5_vl_tiny, tmp_path)
    assert iris.server.flags[-2:] == ["--dtype", "bfloat16"]
    assert "--dtype bfloat16`" in iris.how


def test_vllm_env_reaches_vllm_and_its_row_says_so(tmp_path: Path, qwen2_5_vl_tiny: Path):
    venv = tmp_path / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 0.32.0+cpu\n")  # its version
    (venv / "bin" / "python").chmod(0o755)
    reserved = "VLLM_CPU_NUM_OF_RESERVED_CPU=0"
    args = peers.parse_arguments(["--model", str(qwen2_5_vl_tiny), "--vllm-env", reserved])
    args.vllm_venv = venv
    [vllm] = peers.make_servers(args, ["vllm"], qwen2_5_vl_tiny, tmp_path)
    assert vllm.server.env["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "0"
    assert f"VLLM_CPU_KVCACHE_SPACE=4 {reserved} vllm serve MODEL_DIR" in vllm.how


def test_a_dtype_iris_is_told_is_vllms_too(tmp_path: Path, qwen2_5_vl_tiny: Path):
    venv = tmp_path / "vllm-cpu"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 0.32.0+cpu\n")  # its version
    (venv / "bin" / "python").chmod(0o755)
    for iris_flags, vllm_dtype in [("--dtype bfloat16", "bfloat16"), ("", "float32")]:
        args = peers.parse_arguments(["--model", str(qwen2_5_vl_tiny), "--iris-flags", iris_flags])
        args.vllm_venv = venv
        [vllm] = peers.make_servers(args, ["vllm"], qwen2_5_vl_tiny, tmp_path)
        command = vllm.server.command
        assert command[command.index("--dtype") + 1] == vllm_dtype
        assert command.count("--dtype") == 1 and f"--dtype {vllm_dtype}" in vllm.how


def test_agents_taking_turns_come_back_from_the_host_tier(tmp_path: Path, qwen2_5_vl_tiny: Path):
    """`agents` with a KV cache smaller than three agents' histories: without a tier every
    returning agent recomputes its history; the `--kv-offload-gib` variant reloads it, and
    its rows say how much came from host memory and what a page's copy cost."""
    args = peers.parse_arguments(
        ["--quick", "--model", str(qwen2_5_vl_tiny), "--workloads", "agents",
         "--variant", "tier=--kv-offload-gib 0.05", "--kv-tokens", "256", "--out", str(tmp_path)]
    )  # fmt: skip
    servers = peers.make_servers(args, ["iris"], qwen2_5_vl_tiny, tmp_path)
    per_token = peers.kv_bytes_per_token(qwen2_5_vl_tiny, [])
    assert [s.name for s in servers] == ["Iris", "Iris tier"]
    assert servers[1].server.flags[-4:] == [
        "--kv-offload-gib", "0.05", "--kv-cache-memory", str(256 * per_token)
    ]  # fmt: skip
    runs = serve_load.run(args, lambda *_: servers, "agents", bound=False)
    assert [(r.server, r.workload) for r in runs if r.error] == []

    text = (tmp_path / "agents_quick.md").read_text()
    (header, summary), *_ = markdown_tables(text)
    tables = {h[0]: (h, rows) for h, rows in markdown_tables(text)}
    rates = {row[1]: row[2:4] for row in summary if row[0] == "agents"}
    assert rates["of it, host tier"][0] == "–" and float(rates["of it, host tier"][1]) > 0
    assert float(rates["host tier copy µs / KV page"][1]) > 0
    header, rows = tables["round (agent)"]
    column = {name: header.index(name) for name in header}
    returning = [row for row in rows if row[0].startswith("2 (")]
    assert len(returning) == 6  # three agents, two servers
    for row in returning:
        host = row[column["Iris: from host tier tok"]]
        assert (host == "–") if row[1] == "Iris" else int(host) > 0
