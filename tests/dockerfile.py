"""The Dockerfile and the README's `docker run` line, read as data: no container daemon
runs on these machines, so the tests check what can be checked without one."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
README = REPO / "README.md"
IMAGE_TAG = "iris"  # `docker build -t iris .` in both


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    joined = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            result.append((keyword.upper(), rest.strip()))
    return result


def instruction(keyword: str) -> str:
    [value] = [rest for key, rest in instructions() if key == keyword]
    return value


def entrypoint() -> list[str]:
    return json.loads(instruction("ENTRYPOINT"))  # the exec form: no shell in between


def build_arg(name: str) -> str:
    """The default of build argument `name` (`ARG name=default`)."""
    [default] = [
        rest.partition("=")[2]
        for key, rest in instructions()
        if key == "ARG" and rest.startswith(f"{name}=")
    ]
    return default


def base_image() -> str:
    return build_arg("BASE_IMAGE")


def docker_runs() -> dict[str, list[str]]:
    """The `docker run` command in the Dockerfile's header and in the README, as argv."""
    header = "\n".join(
        line.removeprefix("#").strip()
        for line in DOCKERFILE.read_text().splitlines()
        if line.startswith("#")
    )
    return {"Dockerfile": _docker_run(header), "README.md": _docker_run(README.read_text())}


def _docker_run(text: str) -> list[str]:
    [command] = re.findall(r"^docker run .*?(?<!\\)$", text.replace("\\\n", " "), re.M)
    return shlex.split(command)


def container_args(run: list[str]) -> list[str]:
    """What follows the image in a `docker run` argv: the arguments the entry point gets."""
    return run[run.index(IMAGE_TAG) + 1 :]


def option(run: list[str], name: str) -> str:
    """A `docker run` option's value, in either `--name value` or `--name=value` form."""
    for index, arg in enumerate(run):
        if arg == name:
            return run[index + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    raise AssertionError(f"{name} missing from {shlex.join(run)}")
