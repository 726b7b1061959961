"""API key parsing, tenant derivation, authentication and token-bucket rate limits."""

import pytest

from sidecar.server.security import (
    AuthError,
    Authenticator,
    RateLimiter,
    TokenBucket,
    load_api_keys,
    parse_key_entry,
)


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t

    def advance(self, s: float) -> None:
        self.t += s


def test_key_with_explicit_tenant():
    k = parse_key_entry("sk-abc:team-a")
    assert (k.key, k.tenant) == ("sk-abc", "team-a")
    assert "sk-abc" not in k.key_id


def test_key_without_tenant_gets_distinct_derived_tenant():
    a, b = parse_key_entry("alpha"), parse_key_entry("beta")
    assert a.tenant == a.key_id and b.tenant == b.key_id
    assert a.tenant != b.tenant
    assert parse_key_entry("alpha").tenant == a.tenant  # stable across restarts


@pytest.mark.parametrize(
    "entry, needle", [(":tenant", "empty API key"), ("key:", "empty tenant"), ("a b", "whitespace")]
)
def test_bad_key_entries_name_the_setting(entry, needle):
    with pytest.raises(ValueError, match=f"^api_keys: .*{needle}"):
        parse_key_entry(entry, "api_keys")


def test_keys_file_comments_and_line_numbers(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\nk1:t1\n\nk2  # trailing comment\n")
    keys = load_api_keys(["k3:t3"], str(f))
    assert {k: v.tenant for k, v in keys.items() if v.tenant.startswith("t")} == {"k1": "t1", "k3": "t3"}
    assert keys["k2"].tenant == keys["k2"].key_id
    f.write_text("ok\n:broken\n")
    with pytest.raises(ValueError, match=r"^api_keys_file:2: "):
        load_api_keys([], str(f))


def test_missing_keys_file_and_conflicting_tenants():
    with pytest.raises(ValueError, match="^api_keys_file: cannot read"):
        load_api_keys([], "/nonexistent/keys.txt")
    with pytest.raises(ValueError, match="two tenants"):
        load_api_keys(["k:a", "k:b"])


def test_authenticator():
    auth = Authenticator(load_api_keys(["good:acme"]))
    assert auth.check("Bearer good").tenant == "acme"
    assert auth.check("bearer   good ").tenant == "acme"
    for header, msg in [
        (None, "missing"),
        ("", "missing"),
        ("Basic good", "malformed"),
        ("Bearer", "malformed"),
        ("Bearer bad", "invalid"),
        ("Bearer goo", "invalid"),
    ]:
        with pytest.raises(AuthError, match=msg):
            auth.check(header)
    assert Authenticator({}).check(None) is None  # auth off
    assert not Authenticator({}).enabled


def test_token_bucket_refill_and_wait_time():
    clock = FakeClock()
    b = TokenBucket(rate=2.0, capacity=4, clock=clock)
    for _ in range(4):
        assert b.wait_time(1) == 0
        b.take(1)
    assert b.wait_time(1) == pytest.approx(0.5)
    clock.advance(0.25)
    assert b.wait_time(1) == pytest.approx(0.25)
    clock.advance(10)
    assert b.tokens == 4  # capped at capacity
    assert b.wait_time(5) == float("inf")


def test_rate_limiter_requests_per_second_per_key():
    clock = FakeClock()
    rl = RateLimiter(rps=2, burst=3, clock=clock)
    assert [rl.acquire("a", 0) for _ in range(3)] == [None, None, None]
    assert rl.acquire("a", 0) == pytest.approx(0.5)
    assert rl.acquire("b", 0) is None  # buckets are per key
    clock.advance(0.5)
    assert rl.acquire("a", 0) is None
    assert rl.acquire("a", 0) == pytest.approx(0.5)


def test_rate_limiter_tokens_per_minute_refuses_without_charging():
    clock = FakeClock()
    rl = RateLimiter(rps=1000, tpm=600, clock=clock)  # 10 tokens/s, capacity 600
    assert rl.acquire("k", 500) is None
    wait = rl.acquire("k", 200)  # 100 left: needs 100 more tokens = 10 s
    assert wait == pytest.approx(10.0)
    assert rl.acquire("k", 100) is None  # the refused request took nothing
    assert rl.acquire("k", 601) == float("inf")
    clock.advance(60)
    assert rl.acquire("k", 600) is None


def test_rate_limiter_off_and_default_burst():
    assert RateLimiter().acquire("k", 10**9) is None
    clock = FakeClock()
    rl = RateLimiter(rps=0.5, clock=clock)  # burst defaults to max(1, rps)
    assert rl.acquire("k", 0) is None
    assert rl.acquire("k", 0) == pytest.approx(2.0)


def test_unused_tokens_are_refunded_up_to_capacity():
    clock = FakeClock()
    rl = RateLimiter(tpm=600, clock=clock)
    assert rl.acquire("k", 500) is None
    assert rl.acquire("k", 200) is not None
    rl.refund("k", 450)  # the request generated only 50 of its tokens
    assert rl.acquire("k", 200) is None
    rl.refund("k", 10**6)
    assert rl.acquire("k", 600) is None and rl.acquire("k", 1) is not None  # capped at capacity
    rl.refund("unknown-key", 5)  # nothing charged, nothing to refund
