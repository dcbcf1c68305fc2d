"""Everything the GPU campaign needs that the lent GPU machine lacks, put in `.whl/`.

The device tool's machines have CUDA PyTorch, Triton and transformers but reach no
package index: whatever else Iris needs travels with the working tree as wheels (the
device tool's README). This script, run here before a campaign, writes into `.whl/`
(git-ignored; it travels when a `run` names it in `carry`):

- Iris's own wheel, built from this tree;
- a wheel of every runtime dependency of Iris (and of `transformers serve`, the peer),
  at the version installed here (the one CI tests; transformers is the parity tests'
  reference), for CPython 3.12 on manylinux x86-64, except torch and a few compiled
  libraries taken from the device's image (`FROM_DEVICE`);
- `SOURCES`, a digest of the tree's Python sources, and `COMMIT`, this tree's commit:
  `bench/gpu/campaign.sh` refuses a wheel built from other sources and passes the commit
  to the results (the device gets no `.git`).

    python -m bench.gpu.prepare          # then: bash bench/gpu/campaign.sh STAGE... (there)

Checked here (2026-11-26) by installing `.whl/` offline, as the campaign does, into a
Python 3.12 venv holding the device's listed versions (transformers 5.17, hub 1.33,
tokenizers 0.23.2) and older ones of the rest (typing-extensions 4.12, regex 2024.11,
hf-xet 1.1, xxhash 3.5) with a stand-in torch 2.11: `pip check` clean.

`python -m bench.gpu.prepare --digest` prints the digest (the campaign's check; it needs
only the standard library, so it runs before anything is installed).
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterable
from email import message_from_bytes
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WHEELS = REPO / ".whl"
# The installed packages' folders (pyproject's package-dir; tests/test_wheel.py holds it)
SOURCE_DIRS = (
    "common",
    "ipc",
    "launch",
    "server",
    "tokenizer_worker",
    "scheduler",
    "tiny_checkpoint",
)
LIMIT_BYTES = 48 << 20  # of the 64 MiB a `run` may carry, with room for the tree
# Beyond Iris's own: `transformers serve` (the peer) needs openai.
EXTRA_ROOTS = ("openai",)
# Taken from the device's image (the device tool's KINDS.md lists each, read 2026-11-17):
# torch and what it brings, and compiled libraries whose version there any of ours
# accepts. Everything else Iris needs goes at this venv's version, the one CI tests
# (tokenizers too: the device's 0.23.2 refuses huggingface-hub 2, which transformers
# 5.24 takes; found by installing the wheels offline over that version set).
FROM_DEVICE = frozenset(
    {"torch", "triton", "numpy", "pillow", "safetensors", "pyyaml", "markupsafe"}
)
# The device's Python 3.12.3 is Ubuntu 24.04's (glibc 2.39); pip matches a manylinux tag's
# glibc version exactly, so every one up to 2.39 is named.
PLATFORMS = (
    *(f"manylinux_2_{minor}_x86_64" for minor in range(39, 16, -1)),
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
)


def source_digest(root: Path = REPO) -> str:
    """sha256 over the Python sources and pyproject.toml, by relative path."""
    digest = hashlib.sha256()
    files = [root / "pyproject.toml"]
    for folder in SOURCE_DIRS:
        files += sorted(p for p in (root / folder).rglob("*") if _is_source(p))
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _is_source(path: Path) -> bool:
    return path.is_file() and "__pycache__" not in path.parts and path.suffix != ".pyc"


def carried(requirements: Iterable[str]) -> dict[str, str]:
    """{name: version here} of what the device must be given: every distribution that
    `requirements` need, transitively and without extras, as installed here, except
    those taken from the device (`FROM_DEVICE`, whose own needs are the device's)."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def runtime(lines: Iterable[str]) -> list[str]:
        parsed = [Requirement(line) for line in lines]
        return [r.name for r in parsed if r.marker is None or r.marker.evaluate({"extra": ""})]

    found: dict[str, str] = {}
    pending = runtime(requirements)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in found or name in FROM_DEVICE:
            continue
        distribution = importlib.metadata.distribution(name)
        found[name] = distribution.version
        pending += runtime(distribution.requires or [])
    return dict(sorted(found.items()))


def build_wheel(out: Path) -> Path:
    """Iris's wheel from a copy of the sources (nothing is written into the tree)."""
    scratch = out / "source"
    scratch.mkdir()
    for name in ("pyproject.toml", "README.md", *SOURCE_DIRS):
        source = REPO / name
        if source.is_dir():
            shutil.copytree(source, scratch / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy(source, scratch / name)
    _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(out),
         str(scratch))  # fmt: skip
    shutil.rmtree(scratch)
    [wheel] = out.glob("iris_serve-*.whl")
    return wheel


def requirements_of(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        return message_from_bytes(archive.read(metadata)).get_all("Requires-Dist") or []


def download(packages: dict[str, str], out: Path) -> None:
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    specs = [f"{name}=={version}" for name, version in packages.items()]
    _pip("download", "--no-deps", "--only-binary=:all:", "--python-version", "3.12",
         "--implementation", "cp", *platforms, "-q", "-d", str(out), *specs)  # fmt: skip


def commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()

    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", *SOURCE_DIRS, "bench")
    return f"{head} + uncommitted changes" if dirty else head


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
                   check=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--digest", action="store_true", help="print the sources' digest")
    args = parser.parse_args()
    if args.digest:
        print(source_digest())
        return
    if WHEELS.exists():
        shutil.rmtree(WHEELS)
    WHEELS.mkdir()
    wheel = build_wheel(WHEELS)
    packages = carried([*requirements_of(wheel), *EXTRA_ROOTS])
    print(f"carried to the device: {', '.join(f'{n} {v}' for n, v in packages.items())}")
    download(packages, WHEELS)
    (WHEELS / "SOURCES").write_text(source_digest() + "\n")
    (WHEELS / "COMMIT").write_text(commit() + "\n")
    total = sum(p.stat().st_size for p in WHEELS.iterdir())
    print(f"{WHEELS}: {len(list(WHEELS.glob('*.whl')))} wheels, {total / 2**20:.1f} MiB")
    if total > LIMIT_BYTES:
        raise SystemExit(f"over {LIMIT_BYTES >> 20} MiB: the tree and .whl/ must travel in 64")


if __name__ == "__main__":
    main()
