"""``sidecar bench spec --step-costs``: the prices its replayed column uses, refused with the option named
when they are not prices."""

from __future__ import annotations

import argparse

import pytest

from sidecar.bench import spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(exit_on_error=False)
    spec.add_arguments(p)
    return p


def test_step_costs_parse():
    assert parser().parse_args(["--step-costs", "1,1.34,1.69"]).step_costs == [1.0, 1.34, 1.69]
    assert parser().parse_args([]).step_costs is None  # the engine's measured prices


@pytest.mark.parametrize("bad", ["1,x", "1", "2,3", "1,2,1.5"])
def test_bad_step_costs_name_the_option(bad, capsys):
    with pytest.raises((argparse.ArgumentError, SystemExit)) as e:
        parser().parse_args(["--step-costs", bad])
    assert "--step-costs" in str(e.value) + capsys.readouterr().err
