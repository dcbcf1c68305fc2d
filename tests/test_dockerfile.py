"""The Docker image, checked without a container daemon (none runs on these machines):
its entry point takes the documented `docker run` arguments, the shared memory it tells
users to give matches what `iris serve` reserves at its defaults, its ports agree, and
the Dockerfile and the README say the same thing. That the wheel it installs brings no
torch of its own is in test_wheel.py (it builds the wheel)."""

from __future__ import annotations

import re

from iris_serve.launch.args import parse_serve_args
from iris_serve.launch.launcher import docker_shm_size, shared_memory_needed
from tests.dockerfile import (
    DOCKERFILE,
    README,
    build_arg,
    container_args,
    docker_runs,
    entrypoint,
    instruction,
    option,
)


def test_the_entry_point_takes_the_documented_docker_run_arguments():
    command = entrypoint()
    assert command[:2] == ["iris", "serve"]  # the console script (test_wheel.py)
    for source, run in docker_runs().items():
        args = parse_serve_args(command[2:] + container_args(run))
        assert args.model == "Qwen/Qwen2.5-VL-3B-Instruct", source
        assert args.served_model_name == ["qwen2.5-vl"], source
        assert args.host == "0.0.0.0", "inside a container the server must listen beyond lo"


def test_every_shm_size_the_docs_give_is_what_iris_serve_reserves_at_its_defaults():
    needed = shared_memory_needed(parse_serve_args([]))
    assert needed == 2 * 2**30  # as the Dockerfile says: two workers, a 1 GiB arena each
    for path in (DOCKERFILE, README):
        sizes = re.findall(r"--shm-size[ =](\w+)", path.read_text())
        assert sizes and set(sizes) == {docker_shm_size(needed)}, path.name


def test_one_port_is_exposed_served_published_and_health_checked():
    command = entrypoint()
    port = command[command.index("--port") + 1]
    assert instruction("EXPOSE") == port
    health = re.search(r"http://127\.0\.0\.1:(\d+)/health", instruction("HEALTHCHECK"))
    assert health is not None and health.group(1) == port
    for source, run in docker_runs().items():
        assert option(run, "-p").split(":")[-1] == port, source


def test_the_readme_and_the_dockerfile_show_the_same_docker_run():
    runs = docker_runs()
    assert runs["README.md"] == runs["Dockerfile"]


def test_the_dynamo_build_installs_the_versions_the_extra_and_the_readme_name():
    """`--build-arg WITH_DYNAMO=1` installs Dynamo's runtime through the `[dynamo]` extra
    and its frontend package at the version the extra pins and the README's recipe
    installs (a bump in one place alone would pair a frontend with another runtime)."""
    from tests.dockerfile import REPO

    pyproject = (REPO / "pyproject.toml").read_text()  # (tomllib is 3.11's; Iris runs on 3.10)
    [version] = re.findall(r'^dynamo = \["ai-dynamo-runtime==([\w.]+)"\]$', pyproject, re.M)
    assert build_arg("WITH_DYNAMO") == "0"  # the default image stays without it
    run = instruction("RUN")
    assert "pip install '.[dynamo]'" in run and 'if [ "$WITH_DYNAMO" = 1 ]' in run
    for path in (DOCKERFILE, README):
        assert set(re.findall(r"ai-dynamo==([\w.]+)", path.read_text())) == {version}, path.name
