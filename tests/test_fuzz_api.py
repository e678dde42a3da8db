"""Property-based fuzzing of the gateway from its own OpenAPI document.

schemathesis reads `/openapi.json` from the real serve loop (the `gateway` fixture: the `tiny`
model, at most 8 new tokens a request) and generates requests for every operation in it, valid ones (positive mode)
and ones that break the schema (negative mode). However a request is wrong, the answer is never
a 5xx, and every 4xx carries its API's error shape (OpenAI's; Anthropic's under `/v1/messages`). Valid requests name the served model and stay
within the server's token limit, so that they reach generation instead of stopping at a 404 or
400. The budget is bounded: `EXAMPLES` requests per operation and mode.

schemathesis's own pytest integration (`schemathesis.pytest.from_fixture`, 4.32) fails under
pytest 9.2 (it uses `Function._nodeid`, which pytest 9.2 no longer has), so hypothesis drives
each operation's strategy (`APIOperation.as_strategy`) here.
"""

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from factories import assert_api_error

EXAMPLES = 60
MAX_NEW_TOKENS = 8  # the fixture's serve.max_new_tokens
OPERATIONS = {
    "/v1/chat/completions": {"post"},
    "/v1/completions": {"post"},
    "/v1/responses": {"post"},
    "/v1/responses/{response_id}": {"get"},
    "/v1/messages": {"post"},
    "/v1/messages/count_tokens": {"post"},
    "/v1/sessions/{session_id}/feedback": {"post"},
    "/v1/sessions/{session_id}/end": {"post"},
    "/v1/models": {"get"},
    "/v1/memory": {"get", "delete"},  # a person: named in X-User-Id (a DELETE without one: 400)
    "/v1/adapter": {"get"},  # the end user's own adapter: named in X-User-Id, which the schema does not hold (400)
    "/v1/adapter/rollback": {"post"},
    "/health": {"get"},
    "/admin/tenants": {"get", "post"},  # the tenant admin API: refused (403) by a gateway with no admin key
    "/admin/tenants/{name}": {"patch"},
    "/admin/tenants/{name}/keys": {"post"},
    "/admin/tenants/{name}/keys/{key_id}": {"delete"},
    "/admin/forget": {"post"},
    "/admin/adapters/rollback": {"post"},
    "/admin/memory/clear": {"post"},
    "/admin/audit": {"get"},
}

WITH_BODY = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/v1/messages/count_tokens",
             "/v1/sessions/{session_id}/feedback", "/v1/adapter/rollback", "/admin/adapters/rollback",
             "/admin/memory/clear"}


@pytest.fixture(scope="module")
def api_schema(gateway):
    return schemathesis.openapi.from_url(f"{gateway.url}/openapi.json")


def served(case: schemathesis.Case) -> schemathesis.Case:
    """A valid case made one this server can serve: its model, its token limit."""
    if isinstance(case.body, dict):
        if "model" in case.body:
            case.body["model"] = "tiny"
        for key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(key), int):
                case.body[key] = min(case.body[key], MAX_NEW_TOKENS)
    return case


def test_the_openapi_document_covers_the_api(gateway):
    document = httpx.get(f"{gateway.url}/openapi.json", timeout=30).json()
    assert {path: set(operations) for path, operations in document["paths"].items()} == OPERATIONS
    body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]
    assert body["schema"] == {"$ref": "#/components/schemas/ChatCompletionRequest"}


@pytest.mark.parametrize("path, method, mode", [
    (path, method, mode) for path, methods in OPERATIONS.items() for method in sorted(methods) for mode in GenerationMode
    if mode is GenerationMode.POSITIVE or path in WITH_BODY  # nothing else can be made invalid
], ids=lambda value: value.value if isinstance(value, GenerationMode) else value)
def test_no_generated_request_gets_a_5xx(api_schema, gateway, path, method, mode):
    strategy = api_schema[path][method.upper()].as_strategy(generation_mode=mode)
    if mode is GenerationMode.POSITIVE:
        strategy = strategy.map(served)
    statuses: list[int] = []

    @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def check(case: schemathesis.Case) -> None:
        response = case.call(base_url=gateway.url, timeout=60)
        statuses.append(response.status_code)
        assert response.status_code < 500, f"{case.as_curl_command(base_url=gateway.url)}\n{response.text}"
        if response.status_code >= 400:
            assert_api_error(response, path)

    check()
    assert statuses  # requests were sent
    if mode is GenerationMode.POSITIVE and method == "get" and "{" not in path:  # a made-up response id is a 404
        expected = {403} if path.startswith("/admin/") else {400} if path == "/v1/adapter" else {200}
        assert set(statuses) == expected  # no admin key: the admin API refuses


def test_the_schema_documents_openais_error_object_not_fastapis_422():
    from fastapi import FastAPI

    from flywheel.serve.api.errors import ERROR_SCHEMA, install_error_handlers

    app = FastAPI()
    install_error_handlers(app)

    @app.post("/v1/echo")
    async def echo(body: dict) -> dict:
        return body

    schema = app.openapi()
    responses = schema["paths"]["/v1/echo"]["post"]["responses"]
    assert "422" not in responses and responses["400"]["content"]["application/json"]["schema"] == ERROR_SCHEMA
    assert "HTTPValidationError" not in schema.get("components", {}).get("schemas", {})
