"""Every command and benchmark prints its help: a stray '%' in a help text makes argparse raise instead."""

from __future__ import annotations

import contextlib
import io

import pytest

from sidecar import cli

ARGVS = (
    [["--help"], ["bench", "--help"]]
    + [[name, "--help"] for name in cli.COMMANDS]
    + [["bench", name, "--help"] for name in cli.BENCHMARKS]
)


@pytest.mark.parametrize("argv", ARGVS, ids=[" ".join(a) for a in ARGVS])
def test_help_prints_and_names_the_usage(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exc:
        cli.build_parser(argv).parse_args(argv)
    assert exc.value.code == 0
    assert out.getvalue().startswith("usage: sidecar")
