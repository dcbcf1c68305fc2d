"""The package map of DESIGN.md ("Packages and seams"), read from the source with `ast`.

- `ipc` imports no role;
- a role (server, tokenizer_worker, scheduler) imports only `iris_serve.ipc` and itself;
- the launcher and CLI modules of the server (`LAUNCHERS`), which start and compose the
  roles, may also import another role's public surface, and only that:
  `from iris_serve.<role> import X` with X in that package's `__all__`, never a submodule.

Every import counts, wherever it is: module level, inside a function (lazy), under
`TYPE_CHECKING`, relative, and `importlib.import_module("...")` with a literal name. The
repository's folder names (`server`, `scheduler`, ...) and `bench`/`tests` are never
imported as top-level packages by the roles: installed, only `iris_serve` exists.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = ("server", "tokenizer_worker", "scheduler")
PACKAGES = (*ROLES, "ipc")  # folder == the package's name under iris_serve
LAUNCHERS = {"iris_serve.server.launcher", "iris_serve.server.cli", "iris_serve.server.args"}
NOT_IMPORTABLE = {*PACKAGES, "bench", "tests", "iris"}  # as top-level names, from a role


def module_name(path: Path) -> str:
    """`scheduler/models/loader.py` → `iris_serve.scheduler.models.loader`."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(("iris_serve", *parts))


def public_surface(package: str) -> set[str]:
    """The names in `<package>/__init__.py`'s literal `__all__` (empty if none)."""
    tree = ast.parse((REPO / package / "__init__.py").read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
                return set(ast.literal_eval(node.value))
    return set()


def imports(source: str, module: str, is_package: bool) -> list[tuple[int, str, list[str]]]:
    """(line, imported module, names imported from it) for every import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = node.module or ""
            if node.level:  # relative: resolve against this module's package
                package = module.split(".") if is_package else module.split(".")[:-1]
                base = package[: len(package) - (node.level - 1)]
                target = ".".join([*base, target] if target else base)
            names = [alias.name for alias in node.names]
            if target == "iris_serve":  # `from iris_serve import scheduler`: modules
                found += [(node.lineno, f"iris_serve.{name}", []) for name in names]
            else:
                found.append((node.lineno, target, names))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute | ast.Name)
            and getattr(node.func, "attr", getattr(node.func, "id", None)) == "import_module"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            found.append((node.lineno, node.args[0].value, []))
    return found


def violations(source: str, module: str, is_package: bool = False) -> list[str]:
    """What in `source` (the text of `module`) breaks the map; empty if nothing."""
    own = module.split(".")[1]
    problems = []
    for line, target, names in imports(source, module, is_package):
        parts = target.split(".")
        where = f"{module}:{line}: "
        if parts[0] in NOT_IMPORTABLE:
            problems.append(f"{where}imports top-level `{target}` (use iris_serve.…)")
            continue
        if parts[0] != "iris_serve" or len(parts) < 2 or parts[1] in (own, "ipc"):
            continue  # stdlib, third party, itself, ipc
        if own == "ipc":
            problems.append(f"{where}ipc imports the role module `{target}`")
        elif module in LAUNCHERS and len(parts) == 2 and parts[1] in PACKAGES:
            private = sorted(set(names) - public_surface(parts[1]))
            if not names or private:
                what = ", ".join(private) if private else "the package as a module"
                problems.append(
                    f"{where}imports {what} from `{target}`, outside its public surface "
                    f"(__all__: {', '.join(sorted(public_surface(parts[1])))})"
                )
        else:
            problems.append(f"{where}the {own} role imports `{target}` of another role")
    return problems


def role_modules() -> list[Path]:
    return sorted(path for package in PACKAGES for path in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", role_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_module_keeps_to_the_package_map(path: Path):
    source = path.read_text(encoding="utf-8")
    problems = violations(source, module_name(path), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_every_role_is_checked_and_names_its_public_surface():
    assert {path.relative_to(REPO).parts[0] for path in role_modules()} == set(PACKAGES)
    assert public_surface("scheduler") >= {"EngineConfig", "SchedulerProcessConfig"}
    assert public_surface("scheduler") >= {"run_scheduler", "main_generate"}
    assert public_surface("tokenizer_worker") >= {"WorkerConfig", "run_worker"}
    for launcher in LAUNCHERS:
        assert (REPO / Path(*launcher.split(".")[1:])).with_suffix(".py").is_file()


@pytest.mark.parametrize("package", ["scheduler", "tokenizer_worker"])
def test_the_public_surface_resolves(package: str):
    import importlib

    module = importlib.import_module(f"iris_serve.{package}")
    for name in public_surface(package):
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize(
    ("module", "source"),
    [
        # a worker reaching into the scheduler, at module level or lazily in a function
        ("iris_serve.tokenizer_worker.prompt", "from iris_serve.scheduler.request import Request"),
        ("iris_serve.tokenizer_worker.x", "def f():\n    import iris_serve.scheduler.engine\n"),
        ("iris_serve.tokenizer_worker.x", "from iris_serve import scheduler"),
        ("iris_serve.scheduler.x", "from iris_serve.server.args import GiB"),
        (
            "iris_serve.scheduler.x",
            "import importlib\nimportlib.import_module('iris_serve.server')",
        ),
        ("iris_serve.ipc.x", "from iris_serve.scheduler import EngineConfig"),
        ("iris_serve.ipc.x", "from scheduler.config import EngineConfig"),
        # relative imports that leave the role
        ("iris_serve.scheduler.models.x", "from ...tokenizer_worker import chat"),
        # the launcher: the public surface only, never a submodule or a private name
        ("iris_serve.server.launcher", "from iris_serve.scheduler.process import run_scheduler"),
        ("iris_serve.server.launcher", "from iris_serve.scheduler import ModelRunner"),
        ("iris_serve.server.cli", "import iris_serve.tokenizer_worker"),
        # the rest of the server gets no exception
        ("iris_serve.server.app", "from iris_serve.scheduler import EngineConfig"),
    ],
)
def test_a_planted_bad_import_is_caught(module: str, source: str):
    assert violations(source, module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("iris_serve.server.launcher", "from iris_serve.scheduler import EngineConfig"),
        (
            "iris_serve.server.cli",
            "def f():\n    from iris_serve.tokenizer_worker import run_worker",
        ),
        ("iris_serve.scheduler.models.x", "from ..config import EngineConfig"),
        ("iris_serve.tokenizer_worker.x", "from iris_serve.ipc.messages import Sampling"),
        ("iris_serve.ipc.x", "import msgspec\nfrom iris_serve.ipc import sockets"),
    ],
)
def test_allowed_imports_pass(module: str, source: str):
    assert violations(source, module) == []
