"""The GPU campaign's preparation, which runs here (`bench.gpu.prepare`), and the checks
`bench/gpu/campaign.sh` makes before it installs anything on the GPU machine."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bench.gpu.prepare import (
    EXTRA_ROOTS,
    FROM_DEVICE,
    REPO,
    SOURCE_DIRS,
    build_wheel,
    carried,
    requirements_of,
    source_digest,
)

SCRIPT = Path("bench/gpu/campaign.sh")


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of what the campaign reads: the sources and bench/gpu."""
    root = tmp_path_factory.mktemp("tree")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, root / name)
    for name in SOURCE_DIRS:
        shutil.copytree(REPO / name, root / name, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "bench" / "gpu").mkdir(parents=True)
    for name in ("bench/__init__.py", "bench/gpu/__init__.py", "bench/gpu/prepare.py", SCRIPT):
        shutil.copy(REPO / name, root / name)
    return root


def test_the_device_gets_every_runtime_dependency_at_ci_versions_but_torch(tmp_path: Path):
    wheel = build_wheel(tmp_path)
    packages = carried([*requirements_of(wheel), *EXTRA_ROOTS])
    # Iris's own needs the device image lacks, the peer's (openai), and transformers and
    # its tokenizers at the versions CI tests; never torch (2 GB, CUDA) or what it brings.
    assert {"pyzmq", "msgspec", "fastapi", "starlette", "uvicorn", "pydantic", "llguidance",
            "openai", "transformers", "tokenizers", "huggingface-hub"} <= set(packages)  # fmt: skip
    assert {"torch", "triton", "numpy"} <= FROM_DEVICE
    assert not FROM_DEVICE & set(packages)
    assert not {"sympy", "networkx", "nvidia-cublas"} & set(packages)  # torch's own needs


def test_the_source_digest_follows_the_sources_and_not_their_caches(tree: Path):
    before = source_digest(tree)
    cache = tree / "scheduler" / "__pycache__"
    cache.mkdir()
    (cache / "engine.cpython-312.pyc").write_bytes(b"compiled")
    assert source_digest(tree) == before
    engine = tree / "scheduler" / "step" / "engine.py"
    engine.write_text(engine.read_text() + "\n# changed\n")
    try:
        assert source_digest(tree) != before
    finally:
        engine.write_text(engine.read_text().removesuffix("\n# changed\n"))
        shutil.rmtree(cache)
    assert source_digest(tree) == before


def _campaign(tree: Path, *stages: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(tree / SCRIPT), *stages],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin", "PYTHON": sys.executable, "OUT": str(tree / "out")},
    )


def test_the_campaign_refuses_an_unknown_stage_before_doing_anything(tree: Path):
    result = _campaign(tree, "tests", "benchmark")
    assert result.returncode == 2
    assert "unknown stage: benchmark" in result.stdout
    assert "roofline" in result.stdout  # the usage lists the stages


def test_the_campaign_refuses_wheels_built_from_other_sources(tree: Path):
    wheels = tree / ".whl"
    wheels.mkdir(exist_ok=True)
    (wheels / "SOURCES").write_text("0" * 64 + "\n")
    result = _campaign(tree, "env")
    assert result.returncode == 2
    assert "built from other sources" in result.stdout
    shutil.rmtree(wheels)
    result = _campaign(tree, "env")
    assert result.returncode == 2 and "python -m bench.gpu.prepare" in result.stdout


def test_every_stage_runs_a_benchmark_that_exists_with_flags_it_takes():
    """A stage that calls a removed script, or a flag its script no longer has, would
    only fail on the GPU machine, minutes into a lease."""
    text = (REPO / SCRIPT).read_text()
    stages = re.search(r'case "\$name" in ([\w|]+)\)', text).group(1).split("|")
    usage = text[: text.index("set -euo")]
    assert all(f"#   {stage} " in usage for stage in stages), stages
    calls = re.findall(r'"\$PY" -m (bench[\w.]+) ((?:[^;\n]|\\\n)*)', text)
    assert {module for module, _ in calls} >= {"bench.serve_load", "bench.peers"}
    for module, _ in calls:
        assert (REPO / (module.replace(".", "/") + ".py")).is_file(), module
    asked = {  # each module's --help, once, all at once
        module: subprocess.Popen(
            [sys.executable, "-m", module, "--help"],
            cwd=REPO,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for module in dict.fromkeys(module for module, _ in calls)
    }
    helps = {}
    for module, process in asked.items():
        out, err = process.communicate(timeout=120)
        assert process.returncode == 0, err
        helps[module] = out
    for module, rest in calls:
        own_flags = re.sub(r'"[^"]*"', "", rest)  # a quoted --variant holds iris serve's
        for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", own_flags):
            assert flag in helps[module], f"{module} has no {flag}"
