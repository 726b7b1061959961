"""The command line restarts itself once with glibc's huge-page tunable; Python callers are left alone."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from sidecar import cli


@pytest.fixture
def execs(monkeypatch):
    calls = []
    monkeypatch.setattr(cli.os, "execve", lambda path, argv, env: calls.append((path, list(argv), env)))
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    monkeypatch.delenv("SIDECAR_HUGE_PAGES", raising=False)
    return calls


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables are a Linux matter")
def test_restarts_with_the_tunable_and_the_same_command_line(execs):
    cli.reexec_with_huge_pages()
    assert len(execs) == 1
    path, argv, env = execs[0]
    assert path == sys.executable and argv == sys.orig_argv  # interpreter options (-u, -X ...) kept
    assert env["GLIBC_TUNABLES"] == cli.HUGE_PAGES_TUNABLE
    assert {k: v for k, v in env.items() if k != "GLIBC_TUNABLES"} == dict(os.environ)


@pytest.mark.parametrize(
    "var,value",
    [
        ("GLIBC_TUNABLES", "glibc.malloc.arena_max=2"),  # the user's own
        ("GLIBC_TUNABLES", cli.HUGE_PAGES_TUNABLE),  # the restarted run
        ("SIDECAR_HUGE_PAGES", "0"),
    ],
)
def test_left_alone_when_set_or_switched_off(execs, monkeypatch, var, value):
    monkeypatch.setenv(var, value)
    cli.reexec_with_huge_pages()
    assert execs == []


def test_python_callers_of_main_are_not_restarted(execs):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert execs == []


@pytest.mark.skipif(sys.platform != "linux", reason="glibc tunables are a Linux matter")
def test_a_real_command_runs_with_the_tunable():
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "SIDECAR_HUGE_PAGES")}
    code = "import os; print(os.environ.get('GLIBC_TUNABLES'))"
    # The process restarts itself (same command line) and the second run finds the tunable set.
    res = subprocess.run(
        [sys.executable, "-c", f"from sidecar import cli; cli.reexec_with_huge_pages(); {code}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == cli.HUGE_PAGES_TUNABLE
