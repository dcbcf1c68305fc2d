"""The import graph as grimp reads it: a second tool, independent of the `ast` walk in
tests/test_import_boundaries.py, holding the same package map (`MAP`) to the same code.

grimp finds a package through Python's import system. `iris_serve` itself is a namespace
package whose only path entry is the editable install's import hook, which grimp cannot
list, so the graph is built from the installed packages by name (`iris_serve.scheduler`,
`iris_serve.server`, ...; each resolves to its folder through the hook) plus `bench`,
importable from the repository's root. Imports between them are the graph's arrows; grimp
reads every import statement, lazy and `TYPE_CHECKING` ones included (not
`importlib.import_module`, which the `ast` check covers).

The static tools' view of `iris_serve` (.static/iris_serve/, symlinks to the folders) must
never be what Python imports: the last tests check the modules load from the folders.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

from tests.test_import_boundaries import (
    INSTALLED,
    MAP,
    REPO,
    checked_modules,
    module_name,
    package_of,
)

PACKAGES = (*(f"iris_serve.{package}" for package in INSTALLED), "bench")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def violations(graph: grimp.ImportGraph) -> list[str]:
    """Every arrow of `graph` that breaks `MAP`: a package importing one it may not, or a
    module inside a role it may use through the public surface only. (Which names a
    public import takes is the `ast` check's part: grimp records the module.)"""
    problems = []
    for importer in sorted(graph.modules):
        own = package_of(importer)
        allowed = MAP[own]
        for imported in sorted(graph.find_modules_directly_imported_by(importer)):
            package = package_of(imported)
            if package in (own, *allowed.free):
                continue
            if imported.removeprefix("iris_serve.") in allowed.modules:
                continue
            if package in allowed.public and imported == f"iris_serve.{package}":
                continue
            lines = [
                d["line_number"]
                for d in graph.get_import_details(importer=importer, imported=imported)
            ]
            problems.append(f"{importer}:{lines} imports {imported}")
    return problems


def test_the_graph_holds_every_module(graph: grimp.ImportGraph):
    """Nothing is missing from grimp's view, so nothing escapes the check below."""
    assert graph.modules == {module_name(path) for path in checked_modules()}


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        # relative imports, within the package and up to ipc
        ("iris_serve.scheduler.step.wiring", "iris_serve.scheduler.kv.prefix_cache"),
        ("iris_serve.scheduler.step.engine", "iris_serve.ipc.messages"),
        ("iris_serve.server.serving", "iris_serve.ipc.messages"),
        # the composition root uses a role through its package
        ("iris_serve.launch.launcher", "iris_serve.scheduler"),
        ("iris_serve.launch.launcher", "iris_serve.tokenizer_worker"),
        # bench's absolute imports, at module level and in a function
        ("bench.roofline", "iris_serve.scheduler"),
        ("bench.compute_bound", "iris_serve.tokenizer_worker"),
    ],
)
def test_an_arrow_is_seen(graph: grimp.ImportGraph, importer: str, imported: str):
    assert graph.direct_import_exists(importer=importer, imported=imported)


def test_no_package_breaks_the_map(graph: grimp.ImportGraph):
    problems = violations(graph)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("importer", "imported"),
    [
        ("iris_serve.tokenizer_worker.prompt", "iris_serve.scheduler.step.request"),
        ("iris_serve.scheduler.x", "iris_serve.launch.args"),
        ("iris_serve.ipc.x", "iris_serve.common.grammars"),
        ("iris_serve.tiny_checkpoint.x", "iris_serve.common.grammars"),
        ("iris_serve.launch.launcher", "iris_serve.scheduler.process"),
        ("bench.x", "iris_serve.scheduler.step.engine"),
        ("iris_serve.server.app", "iris_serve.launch"),
    ],
)
def test_a_planted_arrow_is_caught(importer: str, imported: str):
    planted = grimp.ImportGraph()
    planted.add_import(importer=importer, imported=imported, line_number=1, line_contents="")
    assert violations(planted) == [f"{importer}:[1] imports {imported}"]


def test_allowed_arrows_pass():
    allowed = grimp.ImportGraph()
    for importer, imported in [
        ("iris_serve.launch.launcher", "iris_serve.scheduler"),
        ("iris_serve.scheduler.x", "iris_serve.ipc.messages"),
        ("bench.x", "iris_serve.tiny_checkpoint.like"),
        ("iris_serve.tiny_checkpoint.configs", "iris_serve.common.architectures"),
    ]:
        allowed.add_import(importer=importer, imported=imported)
    assert violations(allowed) == []


def test_the_static_links_mirror_the_install():
    """One relative link per installed package, to its folder (.static/README.md)."""
    links = {link.name: link for link in (REPO / ".static" / "iris_serve").iterdir()}
    assert set(links) == set(INSTALLED)
    for package, link in links.items():
        assert link.is_symlink() and os.readlink(link) == f"../../{package}", package
        assert link.resolve() == REPO / package


def loaded_from_static(modules: dict[str, object]) -> list[str]:
    static = REPO / ".static"
    return [
        name
        for name, module in modules.items()
        if name.startswith("iris_serve.")
        and static in Path(getattr(module, "__file__", None) or "/").parents
    ]


def test_pytest_imports_the_folders_not_the_static_links():
    """pytest puts the repository's root on sys.path; .static is not on it."""
    import iris_serve.ipc.messages
    import iris_serve.launch

    assert Path(iris_serve.ipc.messages.__file__).parent == REPO / "ipc"
    assert not loaded_from_static(dict(sys.modules))
    assert not [entry for entry in sys.path if Path(entry or ".").resolve() == REPO / ".static"]


def test_python_from_the_root_imports_the_folders():
    """`python -m ...`/`-c` from the repository's root put the root first on sys.path."""
    code = "import iris_serve.ipc.messages as m, iris_serve; print(m.__file__); print(list(iris_serve.__path__))"
    shown = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert Path(shown[0]) == REPO / "ipc" / "messages.py"
    assert ".static" not in shown[1]
