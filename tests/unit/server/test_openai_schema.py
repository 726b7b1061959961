"""Property-based check of the published OpenAPI schema: no input makes the API answer 5xx.

Schemathesis generates valid and invalid bodies from /openapi.json (in-process,
over the fake service so the run is fast and deterministic) and checks every
response for server errors.
"""

from __future__ import annotations

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error

from sidecar.server.openai.api import create_app
from test_openai_support import FakeService

_service = FakeService()
_service.max_produced = 3
schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(_service))


@schema.parametrize()
@settings(max_examples=30, derandomize=True, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_input_causes_a_server_error(case):
    case.call_and_validate(checks=[not_a_server_error])
