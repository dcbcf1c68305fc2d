"""The names of the tokenizer workers' shared-memory segments, and their sweeping.

Names are `iris-<instance>-w<worker>` with `instance = "<server pid>-<random>"`, so the
server can sweep its own prefix at exit and any segment of a dead pid at start-up
(`shm_arena` has the segments themselves). Apart from it because the launcher needs only
these, before it starts its children, and `shm_arena` imports torch.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

SHM_DIR = Path("/dev/shm")
NAME_PREFIX = "iris-"


def new_instance_id() -> str:
    return f"{os.getpid()}-{secrets.token_hex(4)}"


def instance_prefix(instance: str) -> str:
    return f"{NAME_PREFIX}{instance}-"


def segment_name(instance: str, worker_id: int) -> str:
    return f"{instance_prefix(instance)}w{worker_id}"


def sweep(prefix: str, shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove every segment whose name starts with `prefix`; returns the names."""
    if not prefix.startswith(NAME_PREFIX) or prefix == NAME_PREFIX:
        raise ValueError(f"refusing to sweep {prefix!r}: not one instance's prefix")
    return _remove([n for n in os.listdir(shm_dir) if n.startswith(prefix)], shm_dir)


def sweep_orphans(shm_dir: Path = SHM_DIR) -> list[str]:
    """Remove `iris-<pid>-...` segments whose server pid no longer exists (start-up)."""
    return _remove([n for n in os.listdir(shm_dir) if _is_orphan(n)], shm_dir)


def _is_orphan(name: str) -> bool:
    pid = name.removeprefix(NAME_PREFIX).split("-", 1)[0]
    if not name.startswith(NAME_PREFIX) or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        pass
    return False


def _remove(names: list[str], shm_dir: Path) -> list[str]:
    for name in names:
        (shm_dir / name).unlink(missing_ok=True)
    return names


def check_name(name: str) -> None:
    if not name.startswith(NAME_PREFIX) or "/" in name or name in (".", ".."):
        raise ValueError(f"bad segment name {name!r}: must start with {NAME_PREFIX!r}")
