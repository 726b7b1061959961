"""kv_budget / kv_eviction on the wire: gRPC fields reach the engine's SamplingParams, and a bounded-KV
answer is keyed apart from a full-cache one in the semantic cache."""

import pytest

from sidecar import SamplingParams
from sidecar.server.cache_step import settings_key
from sidecar.server.grpc import servicer
from sidecar.server.validation import ServiceError
from sidecar.v1 import sidecar_pb2 as pb


def test_grpc_fields_reach_the_engine():
    p = servicer._params(pb.SamplingParams(kv_budget=96, kv_eviction="streaming"))
    assert (p.kv_budget, p.kv_eviction) == (96, "streaming")
    unset = servicer._params(pb.SamplingParams())
    assert (unset.kv_budget, unset.kv_eviction) == (None, None)
    with pytest.raises(ServiceError, match=r"^sampling\.kv_eviction: must be one of h2o, streaming"):
        servicer._params(pb.SamplingParams(kv_eviction="lru"))
    with pytest.raises(ServiceError, match=r"^sampling\.kv_budget:"):
        servicer._params(pb.SamplingParams(kv_budget=0))


def test_semantic_cache_key_tells_budgets_apart():
    plain = settings_key(SamplingParams())
    assert "kv_budget" not in plain  # keys of requests without a budget are unchanged
    a = settings_key(SamplingParams(kv_budget=64))
    b = settings_key(SamplingParams(kv_budget=64, kv_eviction="streaming"))
    assert len({plain, a, b}) == 3
