"""API keys, per-key rate limits and tenant isolation over gRPC against a real sidecar."""

from __future__ import annotations

import grpc
import pytest

from sidecar.v1 import sidecar_pb2 as pb
from sidecar.v1 import sidecar_pb2_grpc as pbg

TPM = 200


@pytest.fixture(scope="module")
def server(sidecar_launcher, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# file keys\nfile-key:filetenant\n")
    with sidecar_launcher(
        "--num-kv-blocks",
        "128",
        "--http-port",
        "-1",
        "--api-keys-file",
        str(keys),
        "--api-key",
        "good:acme",
        "--api-key",
        "rate",
        "--api-key",
        "tpm",
        "--api-key",
        "iso-a:tenant-a",
        "--api-key",
        "iso-a2:tenant-a",
        "--api-key",
        "iso-b:tenant-b",
        "--rate-limit-rps",
        "0.2",
        "--rate-limit-burst",
        "3",
        "--rate-limit-tpm",
        str(TPM),
    ) as sc:
        yield sc


@pytest.fixture(scope="module")
def stub(server):
    with grpc.insecure_channel(server.grpc_target) as ch:
        yield pbg.InferenceStub(ch)


def auth(key):
    return (("authorization", f"Bearer {key}"),)


def small(prompt="hello", max_tokens=2):
    return pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=max_tokens))


@pytest.mark.parametrize(
    "metadata, message",
    [
        ((), "missing API key"),
        (auth("wrong"), "invalid API key"),
        ((("authorization", "Basic good"),), "malformed authorization"),
    ],
)
def test_missing_or_wrong_key_is_unauthenticated(stub, metadata, message):
    for call in (
        lambda: stub.Generate(small(), metadata=metadata),
        lambda: list(stub.GenerateStream(small(), metadata=metadata)),
        lambda: stub.GetStats(pb.GetStatsRequest(), metadata=metadata),
        lambda: stub.Tokenize(pb.TokenizeRequest(text="x"), metadata=metadata),
    ):
        with pytest.raises(grpc.RpcError) as exc:
            call()
        assert exc.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert message in exc.value.details()


def test_valid_keys_from_flag_and_file(stub):
    assert stub.Generate(small(), metadata=auth("good")).usage.completion_tokens >= 1
    assert stub.Generate(small(), metadata=auth("file-key")).usage.completion_tokens >= 1


def test_request_rate_limit_per_key_with_retry_after(stub):
    for _ in range(3):  # the burst
        stub.Generate(small(max_tokens=1), metadata=auth("rate"))
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(small(max_tokens=1), metadata=auth("rate"))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "rate limit exceeded" in exc.value.details()
    trailing = dict(exc.value.trailing_metadata())
    # One request per 5 s: the next one fits within 5 s. (Every key here sends at most 3 requests.)
    assert 0 < int(trailing["retry-after-ms"]) <= 5000
    # Another key has its own bucket.
    stub.Generate(small(max_tokens=1), metadata=auth("file-key"))


def test_token_rate_limit(stub):
    # A request costs prompt + max_tokens tokens: 150 + 1 here, so a second one does not fit in TPM.
    costly = pb.GenerateRequest(prompt_token_ids=[5] * 150, sampling=pb.SamplingParams(max_tokens=1))
    stub.Generate(costly, metadata=auth("tpm"))
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(costly, metadata=auth("tpm"))
    assert exc.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert int(dict(exc.value.trailing_metadata())["retry-after-ms"]) > 1000
    with pytest.raises(grpc.RpcError) as exc:
        stub.Generate(small("hi", max_tokens=TPM + 1), metadata=auth("file-key"))
    # It can never fit, so retrying is pointless: bad input, not a rate limit.
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"more than the per-key limit of {TPM} tokens/min" in exc.value.details()


def test_tenants_never_share_prefix_cache_blocks(stub):
    prompt = "Shared system prompt for tenant isolation. " * 6  # several full KV blocks
    req = small(prompt, max_tokens=1)
    first_a = stub.Generate(req, metadata=auth("iso-a"))
    assert first_a.usage.cached_tokens == 0
    # The same tenant (another key of it) reuses the blocks...
    assert stub.Generate(req, metadata=auth("iso-a2")).usage.cached_tokens >= 16
    # ...another tenant does not, nor does the same tenant with a different cache salt.
    assert stub.Generate(req, metadata=auth("iso-b")).usage.cached_tokens == 0
    salted = pb.GenerateRequest(
        prompt=prompt, cache_salt="conversation-2", sampling=pb.SamplingParams(max_tokens=1)
    )
    assert stub.Generate(salted, metadata=auth("iso-a")).usage.cached_tokens == 0
