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


def test_errors_are_documented_as_the_openai_error_the_server_answers(qwen2_vl_tiny: Path) -> None:
    """No operation documents FastAPI's 422 (Iris answers 400s); those taking a body
    document the 400 (and 404 for the model) as OpenAI's error object, and a real
    refusal has that shape, naming its field."""
    app = create_app(settings(qwen2_vl_tiny), FakeEngine(lambda request: Script([[1]])))
    with TestClient(app) as client:
        document = client.get("/openapi.json").json()
        operations = [op for path in document["paths"].values() for op in path.values()]
        assert not any("422" in op["responses"] for op in operations)
        assert "HTTPValidationError" not in document["components"]["schemas"]
        chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
        for status in ("400", "404"):
            reference = chat[status]["content"]["application/json"]["schema"]["$ref"]
            assert reference == "#/components/schemas/ErrorResponse"
        error = document["components"]["schemas"]["ErrorInfo"]
        assert set(error["required"]) == {"message", "type", "param", "code"}
        refused = client.post("/v1/completions", json={"prompt": "hi", "max_tokens": "x"})
        assert refused.status_code == 400 and set(refused.json()["error"]) == set(error["required"])


def test_any_model_id_is_looked_up_and_an_unknown_one_named(qwen2_vl_tiny: Path) -> None:
    """`/v1/models/{id}` takes any id, a line break included (Starlette's `path`
    parameter stops at one): an unknown one is a 404 naming `model`."""
    app = create_app(settings(qwen2_vl_tiny), FakeEngine(lambda request: Script([[1]])))
    with TestClient(app) as client:
        for model_id in ("a%0Ab", "org/name", "x%0D"):
            response = client.get(f"/v1/models/{model_id}")
            assert response.status_code == 404 and response.json()["error"]["param"] == "model"
