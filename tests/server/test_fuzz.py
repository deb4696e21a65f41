"""Every endpoint under generated input, from the server's own /openapi.json (schemathesis):
valid and invalid bodies get no 5xx, the status codes and content types the document
declares, and leave no KV page held."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    status_code_conformance,
)

CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def api_schema(tiny_server):
    schema = schemathesis.openapi.from_url(f"{tiny_server.base_url}/openapi.json")
    schema.config.generation.update(modes=[GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
    return schema


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=12, deadline=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
def test_generated_requests_get_no_server_error(case) -> None:
    case.call_and_validate(checks=CHECKS, timeout=60)


def test_fuzzing_leaves_no_page_held(tiny_server) -> None:
    # Runs after the generated cases (file order): whatever they sent, nothing leaks.
    snapshot = tiny_server.wait_idle()
    assert snapshot is not None


def test_tokenize_with_no_messages_is_a_client_error(tiny_server) -> None:
    import httpx

    r = httpx.post(f"{tiny_server.base_url}/tokenize", json={"messages": []}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "messages"
