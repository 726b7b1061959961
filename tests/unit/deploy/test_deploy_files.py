"""Readers for the deployment files (Dockerfiles, compose, k8s) shared by the test_deploy_* tests.

The readers understand exactly the subset of each format the project's files
use, and the tests at the bottom pin that: a Dockerfile construct they would
misread fails here instead of silently passing the consistency checks.
Also imported by tests/integration/test_deploy_entrypoint.py (by file path).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[3]
DOCKERFILES = {
    "cpu": ROOT / "deploy" / "Dockerfile",
    "cuda": ROOT / "deploy" / "Dockerfile.cuda",
    "chat-demo": ROOT / "java-client" / "examples" / "chat-demo" / "Dockerfile",
}
COMPOSE = ROOT / "docker-compose.yml"
K8S = ROOT / "deploy" / "k8s"
K8S_GPU = ROOT / "deploy" / "k8s-gpu"
# Every image is built with the repository root as its context (docker-compose.yml: context: .).
CONTEXT = ROOT


# --------------------------------------------------------------------------- Dockerfile
# Tokenised by the `dockerfile` package (BuildKit's own parser); this layer only
# picks out what the tests compare and insists on the exec (JSON) forms.


@dataclass
class Copy:
    sources: list[str]
    dest: str
    from_stage: Optional[str]


@dataclass
class Stage:
    base: str
    name: Optional[str]
    instructions: list[Any] = field(default_factory=list)  # dockerfile.Command, in order


@dataclass
class Dockerfile:
    args: dict[str, str]  # ARGs declared before the first FROM (usable in FROM)
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def _last(self, keyword: str):
        found = [c for c in self.final.instructions if c.cmd == keyword]
        return found[-1] if found else None

    def _exec_form(self, keyword: str) -> list[str]:
        c = self._last(keyword)
        if c is None:
            return []
        assert c.json, f"{keyword} must use the exec (JSON) form so signals reach the process: {c.original}"
        return list(c.value)

    @property
    def env(self) -> dict[str, str]:
        """ENV of the final stage, in order; values unexpanded (``$PATH`` stays literal)."""
        out: dict[str, str] = {}
        for c in self.final.instructions:
            if c.cmd == "ENV":
                out.update(zip(c.value[::2], c.value[1::2]))
        return out

    @property
    def entrypoint(self) -> list[str]:
        return self._exec_form("ENTRYPOINT")

    @property
    def cmd(self) -> list[str]:
        return self._exec_form("CMD")

    @property
    def healthcheck(self) -> tuple[dict[str, str], list[str]]:
        """(options such as interval, the CMD in exec form)."""
        c = self._last("HEALTHCHECK")
        if c is None:
            return {}, []
        assert c.value[0] == "CMD" and c.json, f"HEALTHCHECK must be CMD in exec form: {c.original}"
        return {f[2:].split("=", 1)[0]: f.split("=", 1)[1] for f in c.flags}, list(c.value[1:])

    @property
    def expose(self) -> list[int]:
        return [int(p.split("/")[0]) for c in self.final.instructions if c.cmd == "EXPOSE" for p in c.value]

    def runs(self, stage: Stage) -> list[str]:
        return [" ".join(c.value) for c in stage.instructions if c.cmd == "RUN"]

    def copies(self, stage: Optional[Stage] = None) -> list[Copy]:
        out = []
        for st in [stage] if stage else self.stages:
            for c in st.instructions:
                if c.cmd in ("COPY", "ADD"):
                    flags = dict(f[2:].split("=", 1) for f in c.flags if "=" in f)
                    out.append(Copy(list(c.value[:-1]), c.value[-1], flags.get("from")))
        return out

    def container_path_map(self) -> dict[str, Path]:
        """Container path -> repository path, for files the final stage copies from the context."""
        out = {}
        for c in self.copies(self.final):
            if c.from_stage is None and len(c.sources) == 1:
                out[c.dest] = CONTEXT / c.sources[0]
        return out


def parse_dockerfile(path: Path) -> Dockerfile:
    import dockerfile

    args: dict[str, str] = {}
    stages: list[Stage] = []
    for c in dockerfile.parse_file(str(path)):
        if c.cmd == "FROM":
            image = re.sub(
                r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), c.value[0]
            )
            name = c.value[2] if len(c.value) == 3 and c.value[1].upper() == "AS" else None
            stages.append(Stage(image, name))
        elif not stages:
            assert c.cmd == "ARG", f"only ARG may precede FROM, got {c.cmd}"
            key, _, default = c.value[0].partition("=")
            args[key] = default
        else:
            stages[-1].instructions.append(c)
    assert stages, f"{path}: no FROM"
    return Dockerfile(args, stages)


# --------------------------------------------------------------------------- compose

_INTERP = re.compile(r"\$\$|\$\{(\w+)(?:(:?-)([^}]*))?\}")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose variable interpolation (``${X}``, ``${X:-d}``, ``${X-d}``, ``$$``) over a loaded tree."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, default = m.group(1), m.group(2), m.group(3) or ""
        if op == ":-":
            return env.get(name) or default
        if op == "-":
            return env.get(name, default)
        return env.get(name, "")

    return _INTERP.sub(sub, value)


def load_compose(env: Optional[dict[str, str]] = None) -> dict:
    """docker-compose.yml with anchors merged and variables interpolated (defaults when env is empty)."""
    return interpolate(yaml.safe_load(COMPOSE.read_text()), env or {})


def compose_env(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(e.split("=", 1) for e in env)
    return {k: "" if v is None else str(v) for k, v in env.items()}


def container_ports(service: dict) -> list[int]:
    return [int(str(p).rsplit(":", 1)[-1].split("/")[0]) for p in service.get("ports", [])]


# --------------------------------------------------------------------------- kubernetes


def kubectl_available() -> bool:
    return shutil.which("kubectl") is not None


def k8s_documents(directory: Path) -> list[dict]:
    """Resources of a kustomization dir: rendered by `kubectl kustomize` when kubectl exists,
    else the base's files read directly (overlays need kustomize and are then not rendered)."""
    if kubectl_available():
        out = subprocess.run(
            ["kubectl", "kustomize", str(directory)], capture_output=True, text=True, timeout=60
        )
        assert out.returncode == 0, f"kubectl kustomize {directory} failed:\n{out.stderr}"
        return [d for d in yaml.safe_load_all(out.stdout) if d]
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = []
    for res in kust["resources"]:
        assert (directory / res).is_file(), f"without kubectl only file resources can be read: {res}"
        docs += [d for d in yaml.safe_load_all((directory / res).read_text()) if d]
    return docs


def k8s_files() -> list[Path]:
    """Every manifest file (base, optional extras, overlay patches), not kustomizations."""
    files = sorted(K8S.glob("*.yaml")) + sorted(K8S_GPU.glob("*.yaml"))
    return [f for f in files if f.name != "kustomization.yaml"]


def pod_template(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment", "sidecar")["spec"]["template"]


def by_kind(docs: list[dict], kind: str, name: Optional[str] = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# --------------------------------------------------------------------------- sidecar serve


def serve_help_flags() -> set[str]:
    """Flags listed by the real ``sidecar serve --help``."""
    out = subprocess.run(
        [sys.executable, "-m", "sidecar", "serve", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "200"},
    )
    assert out.returncode == 0, out.stderr
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", out.stdout))


def serve_config(args: list[str], env: dict[str, str]):
    """The config ``sidecar serve <args>`` would run with under ``env`` (raises ValueError naming a field)."""
    from sidecar.cli import build_parser
    from sidecar.server.flags import config_from_args

    parsed = build_parser(["serve", *args]).parse_args(["serve", *args])
    return config_from_args(parsed, env=env)


def sidecar_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("SIDECAR_")}


def exported_metric_names(exposition: str) -> set[str]:
    """Series names a PromQL query can select from a text exposition, from its # TYPE lines
    (a labelled counter with no samples yet still counts: its series appear once it moves)."""
    names = set()
    for m in re.finditer(r"^# TYPE (\w+) (\w+)$", exposition, re.M):
        name, kind = m.groups()
        names.add(name)
        if kind == "histogram":
            names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return names


def dashboard_metric_names(dashboard: dict) -> set[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return {n for e in exprs for n in re.findall(r"\bsidecar_\w+", e)}


# Seconds the sidecar may still need after the drain: gRPC stop grace (2 s) and the
# HTTP server's exit wait (5 s) in sidecar/server/app.py Sidecar._drain.
POST_DRAIN_S = 7


def image_config(kind: str, extra_env: dict[str, str] | None = None):
    """Effective config of an image's default command, with the baked YAML read from the repo."""
    df = parse_dockerfile(DOCKERFILES[kind])
    assert df.entrypoint == ["sidecar", "serve"], df.entrypoint
    paths = df.container_path_map()
    args = [str(paths.get(a, a)) for a in df.cmd]
    return serve_config(args, {**sidecar_env(df.env), **(extra_env or {})})


# --------------------------------------------------------------------------- tests of the readers


def test_dockerfile_reader_sees_the_cpu_image_as_built():
    df = parse_dockerfile(DOCKERFILES["cpu"])
    assert [s.name for s in df.stages] == ["build", None]
    assert df.final.base == "python:3.11-slim"
    assert df.entrypoint == ["sidecar", "serve"]
    assert df.cmd[:2] == ["--config", "/etc/sidecar/sidecar.yaml"]
    assert df.env["HF_HOME"] == "/models/huggingface"
    opts, cmd = df.healthcheck
    assert cmd == ["python", "/opt/sidecar/healthcheck.py"] and "start-period" in opts
    assert df.container_path_map()["/etc/sidecar/sidecar.yaml"] == ROOT / "deploy" / "sidecar.yaml"
    assert any(c.from_stage == "build" and c.dest == "/opt/venv" for c in df.copies(df.final))


def test_dockerfile_reader_rejects_what_it_would_misread(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM x\nCMD sidecar serve\n")  # shell form: PID 1 would be /bin/sh, not the sidecar
    with pytest.raises(AssertionError, match="exec"):
        _ = parse_dockerfile(bad).cmd
    bad.write_text("RUN true\nFROM x\n")
    with pytest.raises(AssertionError, match="only ARG"):
        parse_dockerfile(bad)


def test_compose_interpolation_follows_compose_rules():
    tree = {"a": "${X:-d}", "b": "${X-d}", "c": ["${Y}", "$$HOME"]}
    assert interpolate(tree, {}) == {"a": "d", "b": "d", "c": ["", "$HOME"]}
    assert interpolate(tree, {"X": ""}) == {"a": "d", "b": "", "c": ["", "$HOME"]}
    assert interpolate(tree, {"X": "v", "Y": "w"}) == {"a": "v", "b": "v", "c": ["w", "$HOME"]}
