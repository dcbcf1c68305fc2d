"""Writes a benchmark's table to bench/results/ with the machine, command, date and commit."""

from __future__ import annotations

import argparse
import datetime as _dt
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def add_common_arguments(
    parser: argparse.ArgumentParser, quick_help: str = "minimal setting (smoke test)"
) -> None:
    """The flags every benchmark takes: the checkpoint size, the smoke-test setting and
    the results folder."""
    parser.add_argument("--size", choices=("tiny", "small"), default="tiny")
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--out", type=Path, default=None, help="results folder")


# Generated checkpoints a benchmark can serve (`--arch`); the default keeps result names
# as they were (`multiturn_image_small`), another arch is named in them.
ARCH_TITLES = {
    "qwen2_vl": "Qwen2-VL",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen3_vl": "Qwen3-VL",
    "qwen3_vl_moe": "Qwen3-VL-MoE",
    "qwen3_5": "Qwen3.5",
    "qwen3_5_moe": "Qwen3.5-MoE",
}
DEFAULT_ARCH = "qwen2_5_vl"


def add_arch_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--arch",
        choices=tuple(ARCH_TITLES),
        default=DEFAULT_ARCH,
        help=f"architecture of the generated checkpoint (default: {DEFAULT_ARCH})",
    )


def checkpoint_label(arch: str, size: str) -> str:
    """`small` for the default arch, `qwen3_vl_small` for another: part of result names."""
    return size if arch == DEFAULT_ARCH else f"{arch}_{size}"


def add_model_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--model",
        type=Path,
        default=None,
        help="a checkpoint folder to serve instead of the generated one of --arch and --size "
        "(e.g. `iris tiny-model --like Qwen2.5-VL-7B-Instruct`'s; the result is then named "
        "after the folder)",
    )


@dataclass(frozen=True)
class Checkpoint:
    """What a benchmark serves, from `--model` or `--arch`/`--size`."""

    model_dir: Path
    label: str  # in result file names
    title: str  # in result titles
    description: str  # how a result's sentence names it ("generated Qwen2.5-VL `small` checkpoint")

    @property
    def sentence(self) -> str:
        """The description as a result's opening sentence."""
        return f"{self.description[:1].upper()}{self.description[1:]}."

    @classmethod
    def of(cls, args: argparse.Namespace) -> Checkpoint:
        if getattr(args, "model", None) is not None:
            model_dir = args.model.resolve()
            return cls(model_dir, model_dir.name, model_dir.name, f"checkpoint `{model_dir}`")
        from iris_serve.tiny_checkpoint import builtin_checkpoint

        title = f"{ARCH_TITLES[args.arch]} {args.size}"
        return cls(
            builtin_checkpoint(arch=args.arch, size=args.size),
            checkpoint_label(args.arch, args.size),
            title,
            f"generated {ARCH_TITLES[args.arch]} `{args.size}` checkpoint",
        )


def machine_description() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    if torch.cuda.is_available():
        gpu = f"{torch.cuda.get_device_name(0)} (driver {_nvidia_driver()}, CUDA {torch.version.cuda})"
    return (
        f"{cpu}, {os.cpu_count()} cores, {gpu}, torch {torch.__version__}, "
        f"{torch.get_num_threads()} torch threads, Python {platform.python_version()}"
    )


def _nvidia_driver() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True, timeout=30,
        ).stdout.split()[0]  # fmt: skip
    except (OSError, subprocess.SubprocessError, IndexError):
        return "unknown"


def git_commit() -> str:
    """HEAD's short hash, marked when tracked code (results aside) differs from it; on the
    GPU campaign's machine `IRIS_COMMIT` (bench.gpu.prepare: the commit its wheels were
    built from), whatever `.git` the device tool copied there (it may be older)."""
    if os.environ.get("IRIS_COMMIT"):
        return os.environ["IRIS_COMMIT"]
    return checkout_commit(RESULTS_DIR.parent.parent)


def checkout_commit(repo: Path) -> str:
    """The short hash of `repo`'s HEAD, marked when tracked code (results aside) differs
    from it; "unknown" outside a git checkout."""
    try:
        head = _git(repo, "rev-parse", "--short", "HEAD").stdout.strip()
        changed = _git(repo, "status", "--porcelain", "--untracked-files=no", "--", ".",
                       ":(exclude)bench/results").stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return f"{head} + uncommitted changes" if changed else head


def _git(repo: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True, cwd=repo)


def _invocation() -> list[str]:
    """How the running script was started: `-m package.module` or its path."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    if spec is not None and spec.name:
        return ["-m", spec.name]
    return [sys.argv[0]]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    def cell(value: object) -> str:
        return f"{value:.3g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def write_result(name: str, title: str, body: str, results_dir: Path | None = None) -> Path:
    """Prints `body` and saves it as `<results_dir>/<name>.md` with its provenance."""
    results_dir = results_dir or RESULTS_DIR
    results_dir.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", *_invocation(), *sys.argv[1:]])  # pasteable as it is
    text = (
        f"# {title}\n\n"
        f"- date: {_dt.datetime.now().astimezone().isoformat(timespec='seconds')}\n"
        f"- machine: {machine_description()}\n"
        f"- command: `{command}`\n"
        f"- commit: {git_commit()}\n\n"
        f"{body}\n"
    )
    print(text)
    path = results_dir / f"{name}.md"
    path.write_text(text)
    return path
