"""Everything the GPU campaign needs that the lent GPU machine lacks, put in `.whl/`.

The device tool's machines have CUDA PyTorch, Triton and transformers but reach no
package index: whatever else Iris needs travels with the working tree as wheels (the
device tool's README). This script, run here before a campaign, writes into `.whl/`
(git-ignored; it travels when a `run` names it in `carry`):

- Iris's own wheel, built from this tree;
- a wheel of every runtime dependency of Iris (and of `transformers serve`, the peer)
  that the device's image does not have (`DEVICE_PACKAGES`), at the version installed
  here, for CPython 3.12 on manylinux x86-64, plus transformers at this venv's version
  (the parity tests' reference, the same as in CI);
- `SOURCES`, a digest of the tree's Python sources, and `COMMIT`, this tree's commit:
  `bench/gpu/campaign.sh` refuses a wheel built from other sources and passes the commit
  to the results (the device gets no `.git`).

    python -m bench.gpu.prepare          # then: bash bench/gpu/campaign.sh STAGE... (there)

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
SOURCE_DIRS = ("server", "tokenizer_worker", "scheduler", "ipc")
LIMIT_BYTES = 48 << 20  # of the 64 MiB a `run` may carry, with room for the tree
# Beyond Iris's own: `transformers serve` (the peer) needs openai; transformers goes at
# this venv's version whatever the device has.
EXTRA_ROOTS = ("openai",)
ALWAYS = frozenset({"transformers"})
# The device image's Python packages as the device tool's KINDS.md lists them
# (read 2026-11-17), canonical names.
DEVICE_PACKAGES = frozenset(
    """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio
    attrs botorch build certifi charset-normalizer chex click cloudpickle cmake colorama
    contourpy coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x
    cycler cython diffrax e3nn einops equinox etils execnet filelock flatbuffers flax
    fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
    huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax
    jax-cuda13-pjrt jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader
    lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
    markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack
    multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
    numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti nvidia-cuda-nvrtc
    nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
    nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
    nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript
    opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
    packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
    propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
    pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock
    pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests
    rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn
    sentencepiece sentence-transformers setuptools shellingham simplejson six
    sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
    tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio
    torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton
    typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
    wrapt xarray xxhash yarl zipp""".split()  # noqa: SIM905 (read as KINDS.md lists them)
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
    `requirements` need (transitively, without extras, as installed here) that the
    device's image lacks, and `ALWAYS`."""
    import importlib.metadata

    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    def runtime(lines: Iterable[str]) -> list[str]:
        parsed = [Requirement(line) for line in lines]
        return [r.name for r in parsed if r.marker is None or r.marker.evaluate({"extra": ""})]

    seen: dict[str, str] = {}
    pending = runtime(requirements)
    while pending:
        name = canonicalize_name(pending.pop())
        if name in seen:
            continue
        distribution = importlib.metadata.distribution(name)
        seen[name] = distribution.version
        pending += runtime(distribution.requires or [])
    return {
        name: version
        for name, version in sorted(seen.items())
        if name in ALWAYS or name not in DEVICE_PACKAGES
    }


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
