"""The OpenAPI document describes what the server answers (issue 47's first fuzzing run
found it did not), so a client generated from it, or a fuzzer driven by it, can tell a
bug from a rule: `/health`'s empty 200 and `/metrics`' Prometheus text are documented as
such, and a 405 says which methods the path takes."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from iris_serve.server.app import create_app
from tests.fake_engine import FakeEngine, Script, settings


def test_health_and_metrics_answer_as_their_document_says(qwen2_vl_tiny: Path) -> None:
    app = create_app(settings(qwen2_vl_tiny), FakeEngine(lambda request: Script([[1]])))
    with TestClient(app) as client:
        paths = client.get("/openapi.json").json()["paths"]
        health = client.get("/health")
        assert health.status_code == 200 and health.content == b""
        assert "content" not in paths["/health"]["get"]["responses"]["200"]  # no JSON body
        metrics = client.get("/metrics")
        assert metrics.headers["content-type"].startswith("text/plain")
        assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}


def test_a_method_the_path_does_not_take_is_a_405_naming_those_it_does(
    qwen2_vl_tiny: Path,
) -> None:
    app = create_app(settings(qwen2_vl_tiny), FakeEngine(lambda request: Script([[1]])))
    with TestClient(app) as client:
        response = client.get("/v1/chat/completions")
        assert response.status_code == 405 and response.headers["allow"] == "POST"
        assert response.json()["error"]["type"] == "invalid_request_error"
        assert client.delete("/health").headers["allow"] == "GET"
