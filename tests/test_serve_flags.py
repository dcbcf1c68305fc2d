"""`iris serve` cache flags → `WorkerConfig` and `EngineConfig` (no process is started)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from iris_serve.launch import launcher
from iris_serve.launch.args import GiB, ServeArgs, build_parser, parse_serve_args
from iris_serve.launch.launcher import engine_config, worker_config
from iris_serve.scheduler.config import EngineConfig
from iris_serve.tokenizer_worker import WorkerConfig

MiB = 1 << 20
MODEL = Path("/models/tiny")
CACHE_FLAGS = [
    "--mm-embedding-cache-gb", "0.25",
    "--disable-mm-embedding-cache",
    "--max-num-encoder-tokens", "4096",
    "--mm-cache-granularity", "request",
    "--disable-chunked-mm-encoding",
    "--disable-prefix-caching",
]  # fmt: skip
CACHE_FIELDS = {
    "mm_embedding_cache_bytes": GiB // 4,
    "enable_mm_embedding_cache": False,
    "max_num_encoder_tokens": 4096,
    "mm_cache_granularity": "request",
    "chunked_mm_encoding": False,
    "enable_prefix_caching": False,
}


def worker(argv: list[str]) -> Any:
    return worker_config(parse_serve_args(argv), 1, MODEL, "inst", Path("/tmp/run"))


def test_processor_cache_flags_size_the_worker_arena():
    default = worker([])
    assert (default.arena_bytes, default.enable_processor_cache) == (GiB, True)
    assert worker(["--mm-processor-cache-gb", "0.5"]).arena_bytes == 512 * MiB
    assert worker(["--mm-shm-arena-bytes", "128MiB"]).arena_bytes == 128 * MiB
    both = ["--mm-shm-arena-bytes", "128MiB", "--mm-processor-cache-gb", "2"]
    assert worker(both).arena_bytes == 2 * GiB  # the later flag wins
    disabled = worker(["--disable-mm-processor-cache"])
    assert (disabled.arena_bytes, disabled.enable_processor_cache) == (GiB, False)
    assert worker(["--log-level", "debug"]).log_level == "debug"


@pytest.mark.parametrize(
    "argv",
    [
        ["--mm-processor-cache-gb", "0"],
        ["--mm-processor-cache-gb", "-1"],
        ["--mm-shm-arena-bytes", "0"],
        ["--mm-embedding-cache-gb", "nan"],
        ["--max-num-encoder-tokens", "0"],
        ["--scheduler-threads", "0"],
        ["--tokenizer-workers", "0"],
        ["--mm-cache-granularity", "page"],
        ["--tokenizer", "x"],  # not an abbreviation of --tokenizer-workers
        ["--tensor-parallel-size", "0"],
        ["--data-parallel-size", "0"],
    ],
)
def test_bad_flags_are_refused(argv: list[str], capsys):
    with pytest.raises(SystemExit):
        parse_serve_args(argv)
    assert "error" in capsys.readouterr().err


def test_help_tells_the_arena_story():
    text = " ".join(build_parser().format_help().split())
    flags = [flag for flag in CACHE_FLAGS if flag.startswith("--")]
    for flag in ("--mm-processor-cache-gb", "--disable-mm-processor-cache", *flags):
        assert flag in text
    assert "images in flight" in text and "/dev/shm must hold tokenizer-workers x" in text


def test_unset_cache_flags_keep_the_engine_defaults():
    config = engine_config(parse_serve_args(["--block-size", "32"]), MODEL)
    assert config == EngineConfig(model=str(MODEL), page_size=32)


def test_cache_flags_map_to_these_engine_config_fields(monkeypatch):
    seen: dict[str, Any] = {}
    monkeypatch.setattr(launcher, "EngineConfig", lambda **kwargs: seen.update(kwargs))
    engine_config(parse_serve_args(CACHE_FLAGS), MODEL)
    assert {name: seen[name] for name in CACHE_FIELDS} == CACHE_FIELDS


def test_cache_flags_build_a_real_engine_config():
    config = engine_config(parse_serve_args(CACHE_FLAGS), MODEL)
    assert {name: getattr(config, name) for name in CACHE_FIELDS} == CACHE_FIELDS


def test_a_missing_generation_config_folder_fails_before_start_up(qwen2_vl_tiny, tmp_path):
    stderr = serve_fails_fast(str(qwen2_vl_tiny), "--generation-config", str(tmp_path / "nowhere"))
    assert f"--generation-config {tmp_path / 'nowhere'}: no " in stderr


def test_an_engine_setting_out_of_range_is_one_line_before_start_up(qwen2_vl_tiny):
    stderr = serve_fails_fast(str(qwen2_vl_tiny), "--max-itl-stretch", "0.5")
    assert "max_itl_stretch must be above 1, or 0 (off); got 0.5" in stderr
    assert "Traceback" not in stderr


def test_iris_version_names_the_installed_release():
    command = [sys.executable, "-m", "iris_serve.launch.cli", "--version"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout == f"iris {importlib.metadata.version('iris-serve')}\n"


def serve_fails_fast(*argv: str) -> str:
    """`iris serve ARGV` exits 1 before starting any child; returns its stderr."""
    command = [sys.executable, "-m", "iris_serve.launch.cli", "serve", *argv]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    assert "started" not in done.stderr  # no child was started
    return done.stderr


def test_a_busy_port_is_refused_before_start_up(qwen2_vl_tiny):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        stderr = serve_fails_fast(str(qwen2_vl_tiny), "--port", str(port))
    assert f"cannot listen on 127.0.0.1:{port}" in stderr and "--port" in stderr


def test_a_model_that_is_neither_a_folder_nor_on_the_hub_is_one_line(tmp_path):
    """HF_HUB_OFFLINE is set for tests: the hub id is looked up in the local cache only."""
    stderr = serve_fails_fast(str(tmp_path / "no-such-model"))
    assert "no such checkpoint folder" in stderr and "Traceback" not in stderr
    stderr = serve_fails_fast("Qwen/No-Such-Model-7B")
    assert (
        "'Qwen/No-Such-Model-7B': not a checkpoint folder, and the hub could not provide" in stderr
    )
    assert "Traceback" not in stderr


def test_help_shows_each_flags_default_without_importing_torch():
    """`iris serve --help` builds its parser from the config dataclasses alone: no torch,
    no transformers (what made it take seconds), and every flag with a value says its
    default."""
    code = (
        "import sys; from iris_serve.launch.args import build_parser; p = build_parser(); "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); "
        "print(p.format_help())"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0] == "[]"
    configs = {c.__name__: c for c in (ServeArgs, EngineConfig, WorkerConfig)}
    checked = 0
    for action in build_parser()._actions:
        owner, _, name = action.dest.partition(".")  # flags are named after their field
        if owner not in configs:
            continue
        field = next(f for f in dataclasses.fields(configs[owner]) if f.name == name)
        takes_a_value = action.nargs != 0  # not an alias that stores one value
        if field.default is not None and not isinstance(field.default, bool) and takes_a_value:
            assert action.help and "default" in action.help, action.option_strings
            checked += 1
    assert checked > 20


def test_the_launcher_reaches_its_children_without_importing_torch():
    """The launcher starts every child before it imports the heavy half of the stack, so
    the children's imports run at once (a server's start-up on 2 cores: 12.8 -> 9.4-11.1 s,
    bench/results/server_startup_tiny.md):
    the launcher and the roles' entry points it hands to `multiprocessing` load neither
    torch nor transformers."""
    code = (
        "import sys; import iris_serve.launch.launcher; "
        "from iris_serve.scheduler import SchedulerProcessConfig, run_follower, run_scheduler; "
        "from iris_serve.tokenizer_worker import WorkerConfig, run_worker; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_arenas_larger_than_dev_shm_are_refused_with_the_way_out(qwen2_vl_tiny):
    free = launcher.shutil.disk_usage("/dev/shm").free
    size = f"{free // 2**30 + 8}GiB"
    stderr = serve_fails_fast(str(qwen2_vl_tiny), "--mm-shm-arena-bytes", size)
    assert "/dev/shm has" in stderr and "--shm-size" in stderr
    assert "--mm-processor-cache-gb" in stderr


def test_vllm_compatibility_flags_parse():
    args = parse_serve_args(
        ["--trust-remote-code", "--revision", "v1", "--seed", "3", "--chat-template", "t.jinja"]
    )
    assert args.trust_remote_code and args.revision == "v1"
    assert args.engine["seed"] == 3 and args.chat_template == "t.jinja"


def test_a_chat_template_is_a_file_or_the_template_itself(tmp_path):
    template = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(template)
    assert launcher.read_chat_template(str(tmp_path / "t.jinja")) == template
    assert launcher.read_chat_template(template) == template
    assert launcher.read_chat_template(None) is None
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        launcher.read_chat_template(str(tmp_path / "missing.jinja"))
