"""The package map of docs/design.md ("Packages and seams"), read from the source with `ast`.

Each package may import itself, the packages it uses freely, and the public surface of
the roles (`from iris_serve.<role> import X` with X in that package's `__all__`, never a
submodule), as `MAP` says:

- `ipc` (wire types and transport) imports no other package of ours; `tiny_checkpoint`
  (the checkpoint generator) imports one module only, `common.architectures` (the
  architecture table, which imports nothing of ours); `common` imports `ipc` only;
- a role (server, tokenizer_worker, scheduler) imports `ipc`, `common` and itself;
- `launch`, the composition root, and `bench` use the roles through their public
  surfaces only (bench uses `launch`'s the same way).

Every import counts, wherever it is: module level, inside a function (lazy), under
`TYPE_CHECKING`, relative, and `importlib.import_module("...")` with a literal name. The
repository's folder names (`server`, `scheduler`, ...) and `tests` are never imported as
top-level packages: installed, only `iris_serve` exists (and bench is not installed).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROLES = ("server", "tokenizer_worker", "scheduler")


@dataclass(frozen=True)
class Allowed:
    free: tuple[str, ...] = ()  # packages it may import anything from
    public: tuple[str, ...] = ()  # packages it may import only `__all__` names from
    # single modules of other packages it may import from, as "package.module": that
    # module exactly (`from iris_serve.package.module import X`), nothing above or beside it
    modules: tuple[str, ...] = ()


MAP = {
    "ipc": Allowed(),
    "tiny_checkpoint": Allowed(modules=("common.architectures",)),
    "common": Allowed(free=("ipc",)),
    **{role: Allowed(free=("ipc", "common")) for role in ROLES},
    "launch": Allowed(free=("ipc", "common", "tiny_checkpoint"), public=ROLES),
    "bench": Allowed(free=("ipc", "common", "tiny_checkpoint"), public=(*ROLES, "launch")),
}
INSTALLED = tuple(package for package in MAP if package != "bench")  # under iris_serve
NOT_IMPORTABLE = {*MAP, "tests", "iris"}  # as top-level names


def module_name(path: Path) -> str:
    """`scheduler/models/loader.py` → `iris_serve.scheduler.models.loader`;
    `bench/serve_load.py` → `bench.serve_load` (bench is not installed)."""
    parts = path.relative_to(REPO).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts if parts[0] == "bench" else ("iris_serve", *parts))


def package_of(module: str) -> str:
    parts = module.split(".")
    return parts[0] if parts[0] == "bench" else parts[1]


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
    own = package_of(module)
    allowed = MAP[own]
    problems = []
    for line, target, names in imports(source, module, is_package):
        parts = target.split(".")
        where = f"{module}:{line}: "
        if parts[0] in NOT_IMPORTABLE and parts[0] != own:
            problems.append(f"{where}imports top-level `{target}` (use iris_serve.…)")
            continue
        if parts[0] != "iris_serve" or len(parts) < 2:
            continue  # stdlib, third party, bench's own modules
        package = parts[1]
        if package in (own, *allowed.free) or ".".join(parts[1:]) in allowed.modules:
            continue
        if package in allowed.public and len(parts) == 2:
            surface = public_surface(package)
            private = sorted(set(names) - surface)
            if not names or private:
                what = ", ".join(private) if private else "the package as a module"
                problems.append(
                    f"{where}imports {what} from `{target}`, outside its public surface "
                    f"(__all__: {', '.join(sorted(surface))})"
                )
        elif package in allowed.public:
            problems.append(
                f"{where}imports the submodule `{target}`: {own} uses {package} through "
                f"its public surface only (`from iris_serve.{package} import X`)"
            )
        else:
            problems.append(f"{where}{own} may not import `{target}` (docs/design.md)")
    return problems


def checked_modules() -> list[Path]:
    return sorted(path for package in MAP for path in (REPO / package).rglob("*.py"))


@pytest.mark.parametrize("path", checked_modules(), ids=lambda p: str(p.relative_to(REPO)))
def test_module_keeps_to_the_package_map(path: Path):
    source = path.read_text(encoding="utf-8")
    problems = violations(source, module_name(path), path.name == "__init__.py")
    assert not problems, "\n".join(problems)


def test_every_package_is_on_the_map():
    """A new top-level package is placed on the map deliberately."""
    packages = {
        path.parent.name for path in REPO.glob("*/__init__.py") if path.parent.name != "tests"
    }
    assert packages == set(MAP)
    assert {path.relative_to(REPO).parts[0] for path in checked_modules()} == set(MAP)


@pytest.mark.parametrize("package", [*ROLES, "launch"])
def test_the_public_surface_resolves(package: str):
    import importlib

    module = importlib.import_module(f"iris_serve.{package}")
    assert public_surface(package), f"{package} names no public surface"
    for name in public_surface(package):
        assert getattr(module, name) is not None, name


@pytest.mark.parametrize(
    ("module", "source"),
    [
        # a worker reaching into the scheduler, at module level or lazily in a function
        (
            "iris_serve.tokenizer_worker.prompt",
            "from iris_serve.scheduler.step.request import Request",
        ),
        (
            "iris_serve.tokenizer_worker.x",
            "def f():\n    import iris_serve.scheduler.step.engine\n",
        ),
        ("iris_serve.tokenizer_worker.x", "from iris_serve import scheduler"),
        ("iris_serve.scheduler.x", "from iris_serve.launch.args import GiB"),
        ("iris_serve.scheduler.x", "from iris_serve.tiny_checkpoint import builtin_checkpoint"),
        (
            "iris_serve.scheduler.x",
            "import importlib\nimportlib.import_module('iris_serve.server')",
        ),
        ("iris_serve.ipc.x", "from iris_serve.scheduler import EngineConfig"),
        ("iris_serve.ipc.x", "from iris_serve.common.grammars import grammar_of"),
        ("iris_serve.ipc.x", "from scheduler.config import EngineConfig"),
        ("iris_serve.common.x", "from iris_serve.server import AppSettings"),
        # the checkpoint generator reads the architecture table and nothing else of common
        ("iris_serve.tiny_checkpoint.x", "from iris_serve.common.grammars import grammar_of"),
        ("iris_serve.tiny_checkpoint.x", "from ..common import architectures"),
        ("iris_serve.tiny_checkpoint.x", "import iris_serve.common"),
        ("iris_serve.tiny_checkpoint.x", "from iris_serve.scheduler.models import config"),
        # relative imports that leave the role
        ("iris_serve.scheduler.models.x", "from ...tokenizer_worker import chat"),
        # the composition root and bench: the public surface only, never a submodule or a
        # private name
        ("iris_serve.launch.launcher", "from iris_serve.scheduler.process import run_scheduler"),
        ("iris_serve.launch.launcher", "from iris_serve.scheduler import Request"),
        ("iris_serve.launch.cli", "import iris_serve.tokenizer_worker"),
        ("bench.x", "from iris_serve.scheduler.step.engine import Engine"),
        ("bench.x", "from iris_serve.launch.launcher import usable_cores"),
        ("bench.x", "from tests.reference import make_image"),
        # no role imports the composition root
        ("iris_serve.server.app", "from iris_serve.launch import parse_serve_args"),
        ("iris_serve.server.app", "from iris_serve.scheduler import EngineConfig"),
    ],
)
def test_a_planted_bad_import_is_caught(module: str, source: str):
    assert violations(source, module)


@pytest.mark.parametrize(
    ("module", "source"),
    [
        ("iris_serve.launch.launcher", "from iris_serve.scheduler import EngineConfig"),
        (
            "iris_serve.launch.cli",
            "def f():\n    from iris_serve.tokenizer_worker import run_worker",
        ),
        ("iris_serve.scheduler.models.x", "from ..config import EngineConfig"),
        ("iris_serve.tokenizer_worker.x", "from iris_serve.ipc.messages import Sampling"),
        ("iris_serve.server.x", "from iris_serve.common.grammars import grammar_error"),
        ("iris_serve.ipc.x", "import msgspec\nfrom iris_serve.ipc import sockets"),
        ("bench.x", "from bench.server_process import IrisServer"),
        ("bench.x", "from iris_serve.scheduler import Engine"),
        ("bench.x", "from iris_serve.tiny_checkpoint.like import like_config"),
        ("iris_serve.tiny_checkpoint.x", "from ..common.architectures import by_model_type"),
        ("iris_serve.tiny_checkpoint.x", "import iris_serve.common.architectures"),
    ],
)
def test_allowed_imports_pass(module: str, source: str):
    assert violations(source, module) == []
