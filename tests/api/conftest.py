"""The HTTP API against a scripted engine (`tests.fake_engine`): `tokenizer` is the tiny
checkpoint's; one app per test module, `client` talks to it through Starlette's
TestClient, and `engine` is reset before each test to stream `fake_engine.TEXT`, one
token per chunk (test_server_live.py serves the app with uvicorn instead)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from iris_serve.server.app import create_app
from tests.fake_engine import FakeEngine, one_token_each, settings


@pytest.fixture(scope="module")
def tokenizer(qwen2_vl_tiny: Path):
    return AutoTokenizer.from_pretrained(qwen2_vl_tiny)


@pytest.fixture(scope="module")
def _app(qwen2_vl_tiny: Path) -> Iterator[tuple[TestClient, FakeEngine]]:
    engine = FakeEngine()
    with TestClient(create_app(settings(qwen2_vl_tiny), engine)) as client:
        yield client, engine


@pytest.fixture
def engine(_app, tokenizer) -> FakeEngine:
    _app[1].reset(one_token_each(tokenizer))
    return _app[1]


@pytest.fixture
def client(_app, engine) -> TestClient:
    return _app[0]
