"""The built wheel installs one top-level package, `iris_serve`, and nothing else.

The wheel is built offline from a copy of the sources (`pip wheel --no-build-isolation
--no-index`, with this environment's setuptools), so the test writes nothing into the
repository. It is then installed with pip into a fresh venv that has no pip and no
dependencies (`pip --python`): what lands in site-packages is exactly what the wheel
installs, and `iris serve --help` runs there, since parsing the flags needs only the
standard library.
"""

from __future__ import annotations

import configparser
import email
import importlib.metadata
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from bench.gpu.prepare import SOURCE_DIRS
from tests.dockerfile import base_image

REPO = Path(__file__).resolve().parents[1]
PACKAGES = SOURCE_DIRS  # the folders that install as iris_serve.<folder>
SOURCES = ("pyproject.toml", "README.md", *PACKAGES)
PACKAGE_DATA = ("chat_template.jinja", "corpus.txt")
KERNELS = REPO / "scheduler" / "cpu_kernels"  # C++ sources, shipped as package data


def pip(*args: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        check=True,
        capture_output=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    source = tmp_path_factory.mktemp("source")
    for name in SOURCES:
        if (REPO / name).is_dir():
            shutil.copytree(
                REPO / name, source / name, ignore=shutil.ignore_patterns("__pycache__")
            )
        else:
            shutil.copy(REPO / name, source / name)
    out = tmp_path_factory.mktemp("wheel")
    pip(
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "-q",
        "-w",
        str(out),
        str(source),
    )
    [built] = out.glob("iris_serve-*.whl")
    return built


def test_every_list_of_the_packages_names_the_same_folders():
    """pyproject's package-dir, the Dockerfile's copies and the lists the tests, the GPU
    campaign and the boundary test read must agree when a package is added."""
    pyproject = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    section = pyproject.split("[tool.setuptools.package-dir]", 1)[1].split("\n[", 1)[0]
    mapped = dict(re.findall(r'^"iris_serve\.(\w+)" = "(\w+)"$', section, re.M))
    assert all(name == folder for name, folder in mapped.items())
    assert set(mapped) == set(PACKAGES)
    dockerfile = (REPO / "Dockerfile").read_text(encoding="utf-8")
    assert set(re.findall(r"^COPY (\w+) \./\1$", dockerfile, re.M)) == set(PACKAGES)


def test_the_wheel_holds_only_the_iris_serve_namespace(wheel: Path):
    names = zipfile.ZipFile(wheel).namelist()
    top = {name.split("/")[0] for name in names}
    [dist_info] = [entry for entry in top if entry.endswith(".dist-info")]
    assert top == {"iris_serve", dist_info}
    assert "iris_serve/__init__.py" not in names  # a PEP 420 namespace package
    for package in PACKAGES:
        for init in (REPO / package).rglob("__init__.py"):  # every subpackage, too
            assert f"iris_serve/{init.relative_to(REPO).as_posix()}" in names
    for data in PACKAGE_DATA:
        assert f"iris_serve/tiny_checkpoint/{data}" in names
    for source in (*KERNELS.glob("*.cpp"), *KERNELS.glob("*.h")):  # built on first use
        assert f"iris_serve/{source.relative_to(REPO).as_posix()}" in names
    record = zipfile.ZipFile(wheel).read(f"{dist_info}/RECORD").decode()
    assert {line.split(",")[0] for line in record.splitlines()} == set(names)


def test_the_console_script_is_the_servers_cli(wheel: Path):
    with zipfile.ZipFile(wheel) as archive:
        [entry_points] = [
            n for n in archive.namelist() if n.endswith(".dist-info/entry_points.txt")
        ]
        parser = configparser.ConfigParser()
        parser.read_string(archive.read(entry_points).decode())
    assert dict(parser["console_scripts"]) == {"iris": "iris_serve.launch.cli:main"}


def test_a_fresh_venv_gets_iris_serve_and_nothing_else_top_level(wheel: Path, tmp_path: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / ("Scripts/python.exe" if sys.platform == "win32" else "bin/python")
    pip("--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel))
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    installed = {path.name for path in Path(purelib).iterdir()}
    assert {name for name in installed if not name.endswith(".dist-info")} == {"iris_serve"}

    check = (
        "import importlib.util, iris_serve.launch.cli, iris_serve.common.content_parts; "
        f"assert iris_serve.launch.cli.__file__.startswith({purelib!r}); "
        f"assert [m for m in {PACKAGES!r} if importlib.util.find_spec(m)] == []"
    )
    subprocess.run([str(python), "-c", check], check=True, cwd=tmp_path, timeout=60)
    script = Path(sysconfig.get_path("scripts", vars={"base": str(venv)})) / "iris"
    result = subprocess.run(
        [str(script), "serve", "--help"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=60,
    )
    assert "--max-model-len" in result.stdout and "--mm-processor-cache-gb" in result.stdout


def test_the_wheel_keeps_the_docker_base_images_cuda_torch(wheel: Path):
    """The Dockerfile's `pip install .` must keep the base image's CUDA torch: the wheel
    asks for a torch that the base image's satisfies, and nothing it depends on asks for
    torch (read from the dependencies' metadata installed here, as pip would read it)."""
    with zipfile.ZipFile(wheel) as archive:
        [metadata] = [n for n in archive.namelist() if n.endswith(".dist-info/METADATA")]
        message = email.message_from_bytes(archive.read(metadata))
    requires = _runtime(message.get_all("Requires-Dist") or [])
    [torch] = [r for r in requires if canonicalize_name(r.name) == "torch"]
    tag = re.fullmatch(r"pytorch/pytorch:(\d+\.\d+\.\d+)-cuda[\d.]+-.*", base_image())
    assert tag is not None, f"the base image {base_image()} is not a pytorch/pytorch CUDA tag"
    assert torch.specifier.contains(Version(tag.group(1)))

    asks_for_torch = []
    seen: set[str] = set()
    pending = [r.name for r in requires if r is not torch]
    while pending:
        name = canonicalize_name(pending.pop())
        if name in seen:
            continue
        seen.add(name)
        dependencies = _runtime(importlib.metadata.distribution(name).requires or [])
        asks_for_torch += [name for r in dependencies if canonicalize_name(r.name) == "torch"]
        pending += [r.name for r in dependencies]
    assert len(seen) > 10, seen  # the walk reached the dependencies' own dependencies
    assert asks_for_torch == []


def _runtime(lines: list[str]) -> list[Requirement]:
    """The requirements that hold without extras, on this interpreter."""
    requirements = [Requirement(line) for line in lines]
    return [r for r in requirements if r.marker is None or r.marker.evaluate({"extra": ""})]
