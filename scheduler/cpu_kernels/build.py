"""Compiling a kernel's C++ file into a shared library PyTorch loads, once per machine.

A kernel is `name.cpp` with the headers here (`vec.h`: the SIMD vector they share). The
library links against the running torch (its headers, `libc10`, `libtorch_cpu` and the
OpenMP runtime torch ships, so `at::parallel_for` shares torch's threads) and is built
with `-march=native` and `-ffp-contract=off` (a product and a sum written apart stay
rounded apart, as PyTorch's ops round them; FMAs are written as FMAs), so the cache key
holds everything it depends on: the source, the headers, the flags, torch's version, the
compiler's and the CPU's feature flags. The cache is `$IRIS_KERNEL_CACHE_DIR`, else
`$IRIS_CACHE_DIR/kernels`, else `~/.cache/iris/kernels`; a build writes a file of its own
and renames it into place, so builds running together (tensor-parallel ranks, test
workers) never load a half-written library, and a new build removes the kernel's older
ones. Within a process a lock makes
one build of a kernel however many threads ask for it first.
`IRIS_CPU_KERNELS=0` turns every kernel off (their PyTorch paths run instead).
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import threading
import uuid
from pathlib import Path

import torch

logger = logging.getLogger("iris.cpu_kernels")

SOURCES = Path(__file__).resolve().parent
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",
    "-fopenmp",
    "-shared",
    "-fPIC",
    "-std=c++20",
    "-w",
)
COMPILE_TIMEOUT_S = 300


def disabled() -> bool:
    """Whether `IRIS_CPU_KERNELS=0` turned the kernels off."""
    return os.environ.get("IRIS_CPU_KERNELS", "1") == "0"


_loaded: dict[str, bool] = {}
_loading = threading.Lock()  # the encoder's thread and the step's may ask for one at once


def load(name: str) -> bool:
    """Builds (or finds in the cache) and loads the kernel `name` (`name.cpp` here), once
    per process; False, with one logged line saying why, where it cannot."""
    loaded = _loaded.get(name)
    if loaded is not None:
        return loaded
    with _loading:
        if name not in _loaded:
            _loaded[name] = build_and_load(name)
        return _loaded[name]


def build_and_load(name: str) -> bool:
    """`load` without its memory: builds only when the cache has no library for this key."""
    if disabled():
        logger.info("CPU kernel %s: off (IRIS_CPU_KERNELS=0)", name)
        return False
    if platform.machine() not in ("x86_64", "AMD64"):
        logger.info("CPU kernel %s: none for %s; PyTorch's path runs", name, platform.machine())
        return False
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        logger.warning("CPU kernel %s: no C++ compiler (g++); PyTorch's path runs", name)
        return False
    source = SOURCES / f"{name}.cpp"
    library = cache_dir() / f"{name}-{_key(source, compiler)}.so"
    if not library.exists():
        error = _compile(compiler, source, library)
        if error:
            logger.warning("CPU kernel %s did not build; PyTorch's path runs: %s", name, error)
            return False
        logger.info("CPU kernel %s built: %s", name, library)
        _remove_older_builds(library, name)
    torch.ops.load_library(str(library))
    return True


def _remove_older_builds(library: Path, name: str) -> None:
    """Other builds of kernel `name` (another source, torch or CPU): a process that
    loaded one keeps its mapping, so only the cache's size changes."""
    for older in library.parent.glob(f"{name}-*.so"):
        if older != library:
            older.unlink(missing_ok=True)


def cache_dir() -> Path:
    """`$IRIS_KERNEL_CACHE_DIR`, else `$IRIS_CACHE_DIR/kernels`, else `~/.cache/iris/kernels`
    (beside the built-in checkpoints' `models`). A build belongs to the machine, not to a
    checkpoint cache: a private checkpoint cache may still share the machine's kernels."""
    explicit = os.environ.get("IRIS_KERNEL_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("IRIS_CACHE_DIR")
    return (Path(base) if base else Path.home() / ".cache" / "iris") / "kernels"


def _key(source: Path, compiler: str) -> str:
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, check=False
    ).stdout
    headers = [header.read_bytes() for header in sorted(SOURCES.glob("*.h"))]
    parts = [source.read_bytes(), *headers, " ".join(FLAGS).encode(), torch.__version__.encode()]
    parts += [version.encode(), _cpu_flags().encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]


def _cpu_flags() -> str:
    """The CPU's feature flags (what `-march=native` compiles for)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(compiler: str, source: Path, library: Path) -> str | None:
    """Compiles `source` into `library`; the compiler's last lines where it fails."""
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    partial = library.with_name(f"{library.stem}.{uuid.uuid4().hex}.partial")  # this build's
    includes = [f"-I{path}" for path in (SOURCES, *cpp_extension.include_paths())]
    links = []
    for path in cpp_extension.library_paths():
        links += [f"-L{path}", f"-Wl,-rpath,{path}"]
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    command = [compiler, *FLAGS, abi, *includes, str(source), "-o", str(partial), *links]
    command += ["-lc10", "-ltorch_cpu"]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as error:
        partial.unlink(missing_ok=True)
        return str(error)
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        return " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
    os.replace(partial, library)
    return None
