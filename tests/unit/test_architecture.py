"""The package's shape: imports only point down the layers, no module import circles, small files.

Imports are read from the source (ast), never executed, and every import counts, including the lazy
ones inside functions: a lazy import still ties two modules together.

Layers (docs/ARCHITECTURE.md): ``cli -> server, bench -> sidecar (LLM, SamplingParams) -> engine -> model
-> config``, ``server -> cache -> config``, ``v1`` (generated stubs) used by the transports and benches.
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator, NamedTuple

import sidecar

ROOT = Path(sidecar.__file__).resolve().parent.parent

# Which layers each layer may import besides itself. "api" is the package ``sidecar`` itself
# (LLM, SamplingParams, __version__); "cli" is sidecar/cli.py and sidecar/__main__.py.
ALLOWED = {
    "config": set(),
    "v1": set(),
    "model": {"config"},
    "engine": {"config", "model"},
    "cache": {"config"},
    "api": {"engine"},
    "server": {"api", "config", "engine", "cache", "v1"},
    "bench": {"api", "config", "v1"},
    "cli": {"api", "config", "engine", "model", "cache", "server", "bench", "v1"},
}
# Benchmarks measure through the public API and the wire. These few measure a component below the
# engine on its own, or need a model directory on disk for a baseline; none reaches into the engine.
BENCH_COMPONENT_IMPORTS = {
    "sidecar.bench.quant": {
        "sidecar.model.attention",
        "sidecar.model.loader",
        "sidecar.model.demo",
        "sidecar.model.kv_quant",  # the KV cache of teacher-forced perplexity
        "sidecar.model.quant_format",  # quantized-layer kernels, load time and memory
        "sidecar.model.hardware",
    },  # the CPU ISA printed with the figures
    "sidecar.bench.models": {"sidecar.model.demo"},  # where benchmark checkpoints are built
    # the decode attention kernel alone over plain and int8 caches (the KV bytes a decode step reads)
    "sidecar.bench.kv": {"sidecar.model.kv_quant", "sidecar.model.kernels.cpu.paged_attention"},
    # the attention layers' share of a hybrid model's decode step: the same kernel alone at each context
    "sidecar.bench.hybrid": {"sidecar.model.kernels.cpu.paged_attention"},
    "sidecar.bench.report": {"sidecar.model.hardware"},  # the CPU ISA recorded in every report
    # model dir for the HF and llama.cpp baselines; the dtype the engine resolves and the attention backends it
    # allows on CUDA, so all systems match
    "sidecar.bench.throughput": {"sidecar.model.loader", "sidecar.model.hardware", "sidecar.model.attention"},
    "sidecar.bench.prefix": {"sidecar.model.loader"},  # model dir recorded with the results
    "sidecar.bench.semantic_cache": {
        "sidecar.cache.guard",
        "sidecar.cache.embedder",
        "sidecar.cache.semantic",
    },  # the cache's own precision/recall
}
# Measured on ruff-formatted code (one argument a line where a call does not fit 110 columns).
MAX_LINES = 400
SIZE_CAPPED = ("engine", "model")
# The server reaches the engine through AsyncEngine only: LLMEngine is single-threaded and owned by
# AsyncEngine's thread, so nothing on the asyncio side may hold it.
SERVER_FORBIDDEN = {"sidecar.engine.engine"}
# A server function reads as one step of the request path: longer ones hide phases. Counted on formatted
# code, like MAX_LINES.
MAX_SERVER_FUNCTION_LINES = 70


class Edge(NamedTuple):
    src: str
    dst: str
    path: str
    line: int

    def __str__(self) -> str:
        return f"{self.path}:{self.line} imports {self.dst}"


def module_names(root: Path) -> dict[str, Path]:
    """Dotted name -> file for every module of the ``sidecar`` package under ``root``."""
    out = {}
    for path in sorted((root / "sidecar").rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The module an imported name lives in: the longest known module prefix of ``name``."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        cand = ".".join(parts[:n])
        if cand in modules:
            return cand
    return name


def imports(root: Path) -> Iterator[Edge]:
    """Every import of one of our modules by one of our modules (lazy and TYPE_CHECKING ones too)."""
    modules = module_names(root)
    for src, path in modules.items():
        is_pkg = path.name == "__init__.py"
        rel = str(path.relative_to(root))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=rel)):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    pkg = src.split(".") if is_pkg else src.split(".")[:-1]
                    pkg = pkg[: len(pkg) - node.level + 1]
                    base = ".".join(pkg + ([base] if base else []))
                # ``from pkg import mod`` imports the module pkg.mod; ``from mod import name`` imports mod.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
            dsts = {_resolve(t, modules) for t in targets if t == "sidecar" or t.startswith("sidecar.")}
            for dst in sorted(dsts - {src}):
                yield Edge(src, dst, rel, node.lineno)


def layer(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "api"
    if parts[1] in ("cli", "__main__"):
        return "cli"
    return parts[1]


def upward_imports(edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        a, b = layer(e.src), layer(e.dst)
        if a == b or b in ALLOWED.get(a, set()) or e.dst in BENCH_COMPONENT_IMPORTS.get(e.src, ()):
            continue
        bad.append(f"{e} (layer {a} may import only {', '.join(sorted(ALLOWED.get(a, ()))) or 'itself'})")
    return bad


def cycles(edges: list[Edge]) -> list[str]:
    """Each group of modules that import each other (strongly connected, Tarjan), with its edges."""
    graph: dict[str, list[str]] = {}
    for e in edges:
        graph.setdefault(e.src, []).append(e.dst)
        graph.setdefault(e.dst, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [
        " <-> ".join(sorted(g)) + ": " + "; ".join(str(e) for e in edges if e.src in g and e.dst in g)
        for g in groups
    ]


def oversized(root: Path) -> list[str]:
    out = []
    for pkg in SIZE_CAPPED:
        for path in sorted((root / "sidecar" / pkg).rglob("*.py")):
            n = len(path.read_text(encoding="utf-8").splitlines())
            if n > MAX_LINES:
                out.append(
                    f"{path.relative_to(root)}: {n} lines (limit {MAX_LINES}; split it by responsibility)"
                )
    return out


def server_forbidden_imports(edges: list[Edge]) -> list[str]:
    return [
        f"{e} (the server talks to sidecar.engine.async_engine only)"
        for e in edges
        if layer(e.src) == "server" and e.dst in SERVER_FORBIDDEN
    ]


def long_functions(root: Path, package: str = "server", limit: int = MAX_SERVER_FUNCTION_LINES) -> list[str]:
    """Every function (methods and nested ones too) under sidecar/<package> longer than ``limit`` lines,
    decorators and docstring included."""
    out = []
    for path in sorted((root / "sidecar" / package).rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([node.lineno] + [d.lineno for d in node.decorator_list])
                n = node.end_lineno - first + 1
                if n > limit:
                    out.append(
                        f"{rel}:{node.lineno} {node.name}: {n} lines (limit {limit}; split it into steps)"
                    )
    return out


def getattr_chains(root: Path, package: str) -> list[str]:
    """``getattr(getattr(...), ...)``: an untyped reach through collaborators."""
    out = []
    for path in sorted((root / "sidecar" / package).rglob("*.py")):
        rel = path.relative_to(root)
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(rel))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id == "getattr"
                and node.args
                and isinstance(node.args[0], ast.Call)
                and isinstance(node.args[0].func, ast.Name)
                and node.args[0].func.id == "getattr"
            ):
                out.append(f"{rel}:{node.lineno}")
    return out


def any_fields(path: Path, classes: tuple[str, ...]) -> list[str]:
    """Fields of ``classes`` annotated with ``Any`` (class-level annotations and ``self.x: ...`` ones)."""
    out = []
    for cls in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if not (isinstance(cls, ast.ClassDef) and cls.name in classes):
            continue
        for node in ast.walk(cls):
            if isinstance(node, ast.AnnAssign) and any(
                isinstance(n, ast.Name) and n.id == "Any" for n in ast.walk(node.annotation)
            ):
                out.append(f"{cls.name}.{ast.unparse(node.target)}: {ast.unparse(node.annotation)}")
    return out


# ---------------------------------------------------------------- the real package


def test_no_upward_imports_between_layers():
    bad = upward_imports(list(imports(ROOT)))
    assert not bad, "imports against the layer order:\n" + "\n".join(bad)


def test_no_import_cycles_between_modules():
    found = cycles(list(imports(ROOT)))
    assert not found, "modules importing each other:\n" + "\n".join(found)


def test_engine_and_model_files_stay_small():
    big = oversized(ROOT)
    assert not big, "\n".join(big)


def test_server_never_imports_the_engine_core():
    bad = server_forbidden_imports(list(imports(ROOT)))
    assert not bad, "\n".join(bad)


def test_server_functions_stay_short():
    long = long_functions(ROOT)
    assert not long, "\n".join(long)


def test_openai_transport_reaches_collaborators_through_types_not_getattr_chains():
    found = getattr_chains(ROOT, "server")
    assert not found, "getattr chains at " + ", ".join(found)


def test_request_state_is_typed():
    found = any_fields(ROOT / "sidecar" / "engine" / "request.py", ("Request", "SamplingParams"))
    assert not found, "fields typed Any: " + ", ".join(found)


def test_benchmarks_never_import_the_engine_or_the_server():
    bad = [str(e) for e in imports(ROOT) if layer(e.src) == "bench" and layer(e.dst) in ("engine", "server")]
    assert not bad, "benchmarks must drive the engine through sidecar.LLM or the wire:\n" + "\n".join(bad)


def test_the_walk_sees_the_known_import_structure():
    edges = {(e.src, e.dst) for e in imports(ROOT)}
    # A top-level import, a lazy one inside a function, and ``from package import module``.
    assert ("sidecar.engine.runner", "sidecar.engine.scheduler") in edges
    assert ("sidecar.server.app", "sidecar.engine.async_engine") in edges
    assert ("sidecar.server.openai.api", "sidecar.server.openai.errors") in edges
    assert ("sidecar.bench.prefix", "sidecar") in edges


# ---------------------------------------------------------------- the checks catch what they claim


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for rel, text in files.items():
        p = tmp_path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text, encoding="utf-8")
    return tmp_path


def test_checks_name_planted_violations(tmp_path):
    root = _tree(
        tmp_path,
        {
            "sidecar/__init__.py": "",
            "sidecar/config.py": "",
            "sidecar/model/__init__.py": "",
            "sidecar/model/llama.py": (
                "from sidecar.config import X\n\ndef f():\n    from sidecar.engine import runner\n"
            ),
            "sidecar/engine/__init__.py": "",
            "sidecar/engine/runner.py": "from . import scheduler\n" + "x = 1\n" * MAX_LINES,
            "sidecar/engine/scheduler.py": "def g():\n    import sidecar.engine.runner\n",
            "sidecar/bench/__init__.py": "",
            "sidecar/bench/prefix.py": "from sidecar.engine.engine import LLMEngine\nfrom sidecar import LLM\n",
            "sidecar/engine/engine.py": "",
            "sidecar/engine/request.py": (
                "class Request:\n    def __init__(self):\n        self.detok: Optional[Any] = None\n"
            ),
            "sidecar/server/__init__.py": "",
            "sidecar/server/service.py": (
                "from sidecar.engine import engine\n\n\ndef f(s):\n"
                "    return getattr(getattr(s, 'cfg'), 'x')\n"
                + "    pass\n"
                * (MAX_SERVER_FUNCTION_LINES - 1)
            ),
        },
    )
    edges = list(imports(root))
    up = upward_imports(edges)
    assert any(
        u.startswith("sidecar/model/llama.py:4 imports sidecar.engine.runner (layer model") for u in up
    ), up
    assert any(u.startswith("sidecar/bench/prefix.py:1 imports sidecar.engine") for u in up), up
    assert not any("imports sidecar.config" in u or "imports sidecar " in u for u in up), up
    assert cycles(edges) == [
        "sidecar.engine.runner <-> sidecar.engine.scheduler: "
        "sidecar/engine/runner.py:1 imports sidecar.engine.scheduler; "
        "sidecar/engine/scheduler.py:2 imports sidecar.engine.runner"
    ]
    assert oversized(root) == [
        f"sidecar/engine/runner.py: {MAX_LINES + 1} lines (limit {MAX_LINES}; split it by responsibility)"
    ]
    assert server_forbidden_imports(edges) == [
        "sidecar/server/service.py:1 imports sidecar.engine.engine "
        "(the server talks to sidecar.engine.async_engine only)"
    ]
    assert long_functions(root) == [
        f"sidecar/server/service.py:4 f: {MAX_SERVER_FUNCTION_LINES + 1} lines "
        f"(limit {MAX_SERVER_FUNCTION_LINES}; split it into steps)"
    ]
    assert getattr_chains(root, "server") == ["sidecar/server/service.py:5"]
    assert any_fields(root / "sidecar/engine/request.py", ("Request",)) == [
        "Request.self.detok: Optional[Any]"
    ]
