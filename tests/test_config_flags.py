"""`iris serve` flags are derived from the config dataclasses (`launch.config_flags`)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from iris_serve.launch.args import GiB, ServeArgs, build_parser, parse_serve_args
from iris_serve.scheduler import EngineConfig
from iris_serve.tokenizer_worker import WorkerConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def help_text() -> str:
    return " ".join(build_parser().format_help().split())


def test_every_flag_the_readme_names_is_listed_in_the_help():
    readme = README.read_text(encoding="utf-8")
    section = readme[readme.index("Flags of `iris serve`") : readme.index("## Shape")]
    named = set(re.findall(r"`(--[a-z-]+)", section))
    assert len(named) > 20
    assert named <= set(re.findall(r"--[a-z-]+", help_text()))


def test_no_flag_given_restates_no_default():
    args = parse_serve_args([])
    assert (args.engine, args.worker) == ({}, {})
    assert args == ServeArgs()


def test_help_shows_the_dataclass_defaults_in_the_flags_units():
    text = help_text()
    assert f"tokens per KV page (default: {EngineConfig.page_size})" in text
    assert f"(default: {EngineConfig.max_num_seqs})" in text
    assert (
        "--kv-cache-memory SIZE bytes of KV cache on CPU (e.g. 4GiB, 512MB) (default: 1GiB)" in text
    )
    assert f"(default: {WorkerConfig.media_timeout_s})" in text


@pytest.mark.parametrize(
    ("argv", "section", "field", "value"),
    [
        (["--mm-embedding-cache-gb", "0.5"], "engine", "mm_embedding_cache_bytes", GiB // 2),
        (["--kv-cache-memory", "4GiB"], "engine", "kv_cache_memory", 4 * GiB),
        (["--kv-cache-memory", "512MB"], "engine", "kv_cache_memory", 512 * 10**6),
        (["--block-size", "32"], "engine", "page_size", 32),
        (["--disable-prefix-caching"], "engine", "enable_prefix_caching", False),
        (["--enforce-eager"], "engine", "enforce_eager", True),
        (["--mm-processor-cache-gb", "1.5"], "worker", "arena_bytes", 3 * GiB // 2),
        (["--allowed-media-domains", "a.org", "b.org"], "worker", "allowed_media_domains",
         ("a.org", "b.org")),
        (["--allow-private-media-hosts"], "worker", "allow_private_media_hosts", True),
        (["--limit-mm-per-prompt", '{"image": 3}'], "worker", "limit_mm_per_prompt",
         {"image": 3}),
        (["--limit-mm-per-prompt", '{"image": 3, "video": 0}'], "worker",
         "limit_mm_per_prompt", {"image": 3, "video": 0}),
        (["--limit-mm-per-prompt", "5"], "worker", "limit_mm_per_prompt", {"image": 5}),
        (["--mm-arena-wait-timeout", "2.5"], "worker", "arena_wait_timeout_s", 2.5),
        (["--mm-encoder-placement", "thread"], "engine", "mm_encoder_placement", "thread"),
        (["--mm-encoder-inline"], "engine", "mm_encoder_placement", "inline"),
        (["--mm-encoder-beside"], "engine", "mm_encoder_placement", "thread"),
        (["--mm-encoder-beside", "--mm-encoder-inline"], "engine", "mm_encoder_placement",
         "inline"),
        (["--mm-encoder-inline", "--mm-encoder-placement", "thread"], "engine",
         "mm_encoder_placement", "thread"),
    ],
)  # fmt: skip
def test_a_flag_sets_its_field_in_the_fields_unit(argv, section, field, value):
    assert getattr(parse_serve_args(argv), section) == {field: value}


def test_a_field_without_flag_metadata_has_no_flag():
    assert "--num-kv-pages" not in help_text() and "--worker-id" not in help_text()


def test_engine_config_resolves_dtypes_without_importing_torch_up_front():
    config = EngineConfig(model="m", dtype="bf16")
    assert config.resolved_dtype(torch.device("cpu")) is torch.bfloat16
    assert EngineConfig(model="m").resolved_dtype(torch.device("cpu")) is torch.float32
    with pytest.raises(ValueError, match="unknown dtype"):
        EngineConfig(model="m", dtype="int3").resolved_dtype(torch.device("cpu"))


def test_parsing_serve_flags_imports_no_torch():
    """`iris serve --help` answers at once: the configs load torch only when used."""
    code = (
        "import sys; from iris_serve.launch.args import parse_serve_args; "
        "parse_serve_args(['--block-size', '8']); "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


@pytest.mark.parametrize(
    ("given", "device", "placement"),
    [
        ("auto", "cpu", "thread"),
        ("auto", "cuda", "inline"),
        ("inline", "cpu", "inline"),
        ("thread", "cuda", "thread"),
    ],
)
def test_the_vision_encoder_runs_in_a_thread_on_a_cpu_and_inline_on_cuda(given, device, placement):
    """Unless a flag says otherwise (measured: `EngineConfig.resolved_mm_encoder_placement`)."""
    config = EngineConfig(model="m", mm_encoder_placement=given)
    assert config.resolved_mm_encoder_placement(torch.device(device)) == placement


def test_without_chunked_encoding_the_vision_encoder_runs_inline():
    config = EngineConfig(model="m", mm_encoder_placement="thread", chunked_mm_encoding=False)
    assert config.resolved_mm_encoder_placement(torch.device("cpu")) == "inline"


def test_the_old_encoder_flags_say_they_are_deprecated():
    text = " ".join(help_text().split())
    for old, new in (("inline", "inline"), ("beside", "thread")):
        assert f"--mm-encoder-{old} deprecated" in text
        assert f"use --mm-encoder-placement {new}" in text
