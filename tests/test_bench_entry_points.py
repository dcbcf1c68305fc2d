"""Every benchmark entry point has a smoke test, so none can rot unseen; and the smoke
tests of the entry points no benchmark test runs otherwise: the `ignore_eos` proxy, the
`transformers serve` launcher and the GPU campaign's digest."""

from __future__ import annotations

import http.server
import json
import re
import subprocess
import sys
import threading
from pathlib import Path

import httpx

from bench.server_process import free_port
from tests.bench_smoke import REPO, bench_process

INVOCATION = r'(?:(?:run_bench|bench_process)\(\s*|"-m",\s*){module}"'


def entry_points() -> list[str]:
    """`bench.*` and `bench.gpu.*` modules a user runs: those with a `main()` or a
    `__main__` block."""
    found = []
    for path in sorted([*REPO.glob("bench/*.py"), *REPO.glob("bench/gpu/*.py")]):
        text = path.read_text()
        if 'if __name__ == "__main__"' in text or re.search(r"^def main\(", text, re.M):
            found.append(".".join(path.relative_to(REPO).with_suffix("").parts))
    return found


def test_every_bench_entry_point_is_run_by_a_test():
    tests = "\n".join(p.read_text() for p in (REPO / "tests").glob("*.py"))
    points = entry_points()
    assert {"bench.serve_load", "bench.peers", "bench.gpu.prepare"} <= set(points)
    untested = [m for m in points if not re.search(INVOCATION.format(module=f'"{m}'), tests)]
    assert not untested, (
        f"{untested}: no test runs these (run_bench / bench_process / `-m`); give each a "
        "smoke test with its --quick setting (tests/bench_smoke.py)"
    )


class Echo(http.server.BaseHTTPRequestHandler):
    """An upstream that answers GET with 200 and POST with the body it received."""

    def do_GET(self) -> None:
        self._answer(b"{}")

    def do_POST(self) -> None:
        self._answer(self.rfile.read(int(self.headers["Content-Length"])))

    def _answer(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_the_proxy_forwards_requests_without_ignore_eos():
    upstream = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Echo)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    command = [sys.executable, "-m", "bench.drop_fields_proxy", "--port", str(port),
               "--upstream", f"http://127.0.0.1:{upstream.server_port}",
               "--ignore-eos-as-min-new-tokens"]  # fmt: skip
    proxy = subprocess.Popen(command, cwd=REPO)
    try:
        url = f"http://127.0.0.1:{port}/v1/chat/completions"
        body = {"model": "m", "ignore_eos": True, "max_tokens": 4}
        for _ in range(100):  # its start-up, bounded
            try:
                answer = httpx.post(url, json=body, timeout=5)
                break
            except httpx.ConnectError:
                threading.Event().wait(0.1)
        assert json.loads(answer.content) == {
            "model": "m", "max_tokens": 4, "generation_config": '{"min_new_tokens": 4}'
        }  # fmt: skip
    finally:
        proxy.terminate()
        proxy.wait(timeout=30)
        upstream.shutdown()


def test_the_transformers_serve_launcher_starts_the_stock_cli(tmp_path: Path, qwen2_5_vl_tiny):
    done = bench_process("bench.transformers_serve_launcher", "--help", cache_dir=tmp_path,
                         timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "FORCE_MODEL" in done.stdout
    from bench.transformers_serve_launcher import _load_processor

    processor = _load_processor(None, str(qwen2_5_vl_tiny))  # type: ignore[arg-type]
    assert getattr(processor, "video_processor", None) is None  # no torchvision needed


def test_the_gpu_campaigns_digest_is_printed_for_the_device(tmp_path: Path):
    done = bench_process("bench.gpu.prepare", "--digest", cache_dir=tmp_path, timeout=120)
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"[0-9a-f]{64}", done.stdout.strip())


def test_every_result_file_is_linked_from_the_bench_readme():
    """A result outlives its script: the README's table keeps every one findable."""
    readme = (REPO / "bench" / "README.md").read_text()
    results = sorted(p.name for p in (REPO / "bench" / "results").glob("*.md"))
    assert [name for name in results if f"(results/{name})" not in readme] == []
