"""cache_policy: bypass rules and cache_control modes."""

import pytest

from sidecar.cache.semantic import cache_policy


def pol(control="default", temperature=0.0, cache_sampled=False, enabled=True, allow_sampled=False):
    return cache_policy(control, temperature, cache_sampled, enabled, allow_sampled)


def test_default_greedy_looks_up_and_stores():
    p = pol()
    assert (p.lookup, p.store, p.bypass_reason) == (True, True, None)


def test_sampled_requests_bypass_unless_opted_in():
    p = pol(temperature=0.7)
    assert (p.lookup, p.store, p.bypass_reason) == (False, False, "sampled")
    assert pol(temperature=0.7, cache_sampled=True).lookup
    assert pol(temperature=0.7, allow_sampled=True).store


def test_skip_refresh_only():
    assert (pol("skip").lookup, pol("skip").store, pol("skip").bypass_reason) == (False, False, "skip")
    r = pol("refresh")
    assert (r.lookup, r.store, r.bypass_reason) == (False, True, "refresh")
    o = pol("only")
    assert (o.lookup, o.store, o.bypass_reason) == (True, False, None)


def test_only_mode_never_generates_when_it_cannot_look_up():
    # Sampled or disabled: no lookup and no store, so the caller must answer not-found.
    for p in (pol("only", temperature=1.0), pol("only", enabled=False)):
        assert not p.lookup and not p.store and p.bypass_reason


def test_disabled_cache_bypasses():
    assert pol(enabled=False).bypass_reason == "disabled"


@pytest.mark.parametrize("control", ["sometimes", "", "ONLYY"])
def test_bad_cache_control_names_the_field(control):
    if control == "":
        assert pol(control).lookup  # empty means default
        return
    with pytest.raises(ValueError, match="cache_control"):
        pol(control)


def test_negative_temperature_names_the_field():
    with pytest.raises(ValueError, match="temperature"):
        pol(temperature=-1.0)
