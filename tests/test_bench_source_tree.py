"""`bench.server_process.namespace_shim` and `IrisServer(source_tree=...)`: a benchmark
serves another checkout's code (`serve_load --before-tree`) through this venv, so the
shim's `iris_serve.*` must win over the editable install of this tree."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.results_io import checkout_commit
from bench.server_process import PACKAGES, IrisServer, namespace_shim


def fake_tree(root: Path, skip: str = "") -> Path:
    for name in PACKAGES:
        if name != skip:
            (root / name).mkdir(parents=True)
            (root / name / "__init__.py").write_text(f"MARK = 'other tree: {name}'\n")
    return root


def test_the_shim_imports_the_other_trees_packages_before_the_installed_ones(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    shim = namespace_shim(tree)
    try:
        probe = "import iris_serve.scheduler as s, iris_serve.server as v; print(s.MARK, v.MARK, sep='|')"
        env = {**os.environ, "PYTHONPATH": shim.name}
        done = subprocess.run(
            [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=60
        )
    finally:
        shim.cleanup()
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "other tree: scheduler|other tree: server"


def test_a_folder_that_is_not_a_source_tree_is_refused_by_name(tmp_path):
    tree = fake_tree(tmp_path / "tree", skip="tokenizer_worker")
    with pytest.raises(FileNotFoundError, match="tokenizer_worker"):
        namespace_shim(tree)


def test_a_server_from_another_tree_puts_its_shim_first_and_removes_it_on_stop(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    server = IrisServer(tmp_path / "model", env={"PYTHONPATH": "/elsewhere"}, source_tree=tree)
    shim, rest = server.env["PYTHONPATH"].split(os.pathsep)
    assert rest == "/elsewhere"
    assert (Path(shim) / "iris_serve" / "ipc").resolve() == (tree / "ipc").resolve()
    assert server.stop() is None  # never started
    assert not Path(shim).exists()


def test_a_result_names_the_other_trees_commit_and_says_when_it_was_changed(tmp_path):
    tree = fake_tree(tmp_path / "tree")
    assert checkout_commit(tree) == "unknown"  # not a git checkout
    git = ["git", "-C", str(tree), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "tree"], check=True)
    head = subprocess.run(
        [*git, "rev-parse", "--short", "HEAD"], check=True, capture_output=True, text=True
    ).stdout.strip()
    assert checkout_commit(tree) == head
    (tree / "ipc" / "__init__.py").write_text("changed = True\n")
    assert checkout_commit(tree) == f"{head} + uncommitted changes"


def test_a_tree_before_the_composition_root_is_started_through_its_server_cli(tmp_path):
    old = IrisServer(tmp_path / "model", source_tree=fake_tree(tmp_path / "old"))
    new_tree = fake_tree(tmp_path / "new")
    (new_tree / "launch").mkdir()
    (new_tree / "launch" / "__init__.py").write_text("")
    (new_tree / "launch" / "cli.py").write_text("")
    new = IrisServer(tmp_path / "model", source_tree=new_tree)
    try:
        assert old.command[1:3] == ["-m", "iris_serve.server.cli"]
        assert new.command[1:3] == ["-m", "iris_serve.launch.cli"]
        shim = Path(new.env["PYTHONPATH"].split(os.pathsep)[0])
        assert (shim / "iris_serve" / "launch").resolve() == (new_tree / "launch").resolve()
    finally:
        old.stop()
        new.stop()
