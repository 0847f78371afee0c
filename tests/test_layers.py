"""The layout's rules, read from the code's own imports (every import, inside functions and under
TYPE_CHECKING too): no import cycle between ragcache's modules, data flowing one way (app/ui ->
pipeline -> ingest -> index, engine -> blend, kvstore), the SDK never importing app/ or ui/, blend/
never importing vLLM, no module of the core importing bench/ or the test-support package, and
ragcache's root holding only the modules a user imports; and every project import naming something
that exists. No model, no engine."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO


def _module_of(path: Path) -> str:
    rel = path.relative_to(REPO).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


TOPS = ("ragcache", "ragcache_testing", "app", "ui")


def _files() -> dict[str, Path]:
    return {_module_of(p): p for top in TOPS for p in (REPO / top).rglob("*.py")}


def _under(m: str, *packages: str) -> bool:
    """``m`` is one of ``packages`` or a module inside one."""
    return any(m == p or m.startswith(p + ".") for p in packages)


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``path`` imports (``from pkg import name`` counts as pkg.name when that is
    a module, else as pkg)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out.update(n for n in names if n in modules)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _files()
    return {m: _imports(p, modules) - {m} for m, p in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _package_face(m: str) -> bool:
    """A package's ``__init__`` that only hands names on (its own package's modules import it as a whole)."""
    return (REPO / m.replace(".", "/") / "__init__.py").is_file()


def test_no_import_cycle_between_modules():
    graph = _graph()
    # a module importing its own package's face (``from ragcache.engine import X`` inside engine/) is
    # the package handing names on, not a dependency: leave those edges out
    flat = {m: {t for t in ts if not (_package_face(t) and m.startswith(t + "."))} for m, ts in graph.items()}
    assert _cycles(flat) == []


def test_data_flows_one_way_and_the_sdk_never_imports_the_apps():
    graph = _graph()
    above_index = ("ragcache.ingest", "ragcache.engine", "ragcache.pipeline", "ragcache.server", "ragcache.bench",
                   "ragcache.quality", "ragcache.calibrate")
    for m, targets in graph.items():
        def imports(*packages: str) -> list[str]:
            return [t for t in targets if _under(t, *packages)]

        if _under(m, "ragcache"):
            assert not imports("app", "ui"), m
        if _under(m, "ragcache.kvstore", "ragcache.blend"):  # the bottom: nothing above them
            assert not imports("ragcache.engine", "ragcache.pipeline", "ragcache.server", "ragcache.bench",
                               "ragcache.index", "ragcache.ingest", "ragcache.quality", "ragcache.calibrate"), m
        if _under(m, "ragcache.engine"):  # of quality/, only its measures
            assert not imports("ragcache.pipeline", "ragcache.server", "ragcache.bench", "ragcache.index",
                               "ragcache.ingest", "ragcache.calibrate", "ragcache.quality.records"), m
        if _under(m, "ragcache.index"):  # written by ingest, read by the pipeline; knows neither
            assert not imports(*above_index), m
        if _under(m, "ragcache.ingest"):
            assert not imports("ragcache.pipeline", "ragcache.server", "ragcache.bench", "ragcache.quality",
                               "ragcache.calibrate"), m
        if _under(m, "ragcache.quality"):  # below the engine and the pipeline that use it
            assert not imports("ragcache.engine", "ragcache.pipeline", "ragcache.server", "ragcache.bench",
                               "ragcache.ingest", "ragcache.calibrate"), m
        if _under(m, "ragcache.util"):  # process plumbing: below everything
            assert not [t for t in targets if _under(t, "ragcache") and not _under(t, "ragcache.util")], m
        if _under(m, "ragcache") and not _under(m, "ragcache.bench"):  # core never uses bench/ or test support
            assert not imports("ragcache.bench", "ragcache_testing"), m
        if _under(m, "ragcache_testing"):  # standard library only
            assert not imports("ragcache", "app", "ui"), m


def test_the_sdk_root_holds_only_the_modules_a_user_imports():
    """ragcache/'s root is its front door (settings, models, the pipeline, its request and answer types
    and its calibration, the chunk and prompt every layer shares, the selection strategies a user may
    register); everything else lives in a
    subpackage named after its layer (index, ingest, engine, blend, kvstore, quality, server, bench,
    integrations, util)."""
    root = sorted(p.name for p in (REPO / "ragcache").glob("*.py"))
    assert root == ["__init__.py", "calibrate.py", "chunks.py", "config.py", "conversation.py", "models.py",
                    "options.py", "pipeline.py", "prompt.py", "strategies.py"]


def test_blend_never_imports_vllm():
    for path in (REPO / "ragcache" / "blend").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                assert not any(n.split(".")[0] == "vllm" for n in names), path


def test_every_project_import_names_something_that_exists():
    """A ``from ragcache.x import name`` inside a function runs only when that path runs (a CLI flag's
    parser, an error branch): each one must still resolve, so a rename cannot leave a flag that dies
    with ImportError (``bench ttft --selections`` did)."""
    import importlib
    import importlib.util

    missing = []
    for path in _files().values():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                    and node.module.split(".")[0] in ("ragcache", "app", "ui")):
                continue
            module = importlib.import_module(node.module)
            for alias in node.names:
                if alias.name == "*" or hasattr(module, alias.name):
                    continue
                if hasattr(module, "__path__") and importlib.util.find_spec(f"{node.module}.{alias.name}"):
                    continue  # a submodule not imported yet
                missing.append(f"{path.relative_to(REPO)}:{node.lineno} from {node.module} import {alias.name}")
    assert not missing, "imports of names that do not exist:\n" + "\n".join(missing)
