"""Every :func:/:class:/:meth:/:mod:/:data:/:attr:/:exc: reference in ragcache/'s docstrings names a
symbol that exists. Resolved statically (ast, no import of vLLM or the engine): a name is fully
qualified, or relative to the docstring's class, module or package; ``~`` and ``title <target>`` as
Sphinx reads them; a name imported into a module is followed to its source."""

from __future__ import annotations

import ast
import builtins
import importlib
import importlib.util
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "ragcache"
REF = re.compile(r":(func|class|meth|mod|data|attr|exc|obj):`([^`]+)`")


@dataclass
class Scope:
    """A module's or class's names: ``names`` defined there, ``imports`` name -> qualified target,
    ``bases`` (classes) the base names, ``members`` nested scopes."""

    kind: str
    names: set[str] = field(default_factory=set)
    imports: dict[str, str] = field(default_factory=dict)
    bases: list[str] = field(default_factory=list)
    members: dict[str, "Scope"] = field(default_factory=dict)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _collect(body: list[ast.stmt], scope: Scope, module: str, is_package: bool) -> None:
    for node in body:
        if isinstance(node, ast.ClassDef):
            inner = Scope("class", bases=[ast.unparse(b) for b in node.bases])
            _collect(node.body, inner, module, is_package)
            for fn in ast.walk(node):  # self.x = ... in methods: instance attributes
                if isinstance(fn, ast.Attribute) and isinstance(fn.ctx, ast.Store) and \
                        isinstance(fn.value, ast.Name) and fn.value.id == "self":
                    inner.names.add(fn.attr)
            scope.names.add(node.name)
            scope.members[node.name] = inner
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            scope.names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                for n in ast.walk(t):
                    if isinstance(n, ast.Name):
                        scope.names.add(n.id)
        elif isinstance(node, ast.Import):
            for a in node.names:
                scope.imports[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                pkg = module.split(".") if is_package else module.split(".")[:-1]
                pkg = pkg[:len(pkg) - node.level + 1]
                base = ".".join(pkg + ([node.module] if node.module else []))
            for a in node.names:
                scope.imports[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            for block in ("body", "orelse", "finalbody", "handlers"):
                for sub in getattr(node, block, []) or []:
                    _collect(sub.body if isinstance(sub, ast.ExceptHandler) else [sub], scope, module, is_package)


def _index() -> tuple[dict[str, Scope], dict[str, ast.Module]]:
    scopes, trees = {}, {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = _module_name(path)
        tree = ast.parse(path.read_text(encoding="utf-8"))
        scope = Scope("module")
        _collect(tree.body, scope, name, path.name == "__init__.py")
        scopes[name], trees[name] = scope, tree
    return scopes, trees


SCOPES, TREES = _index()


def _external(dotted: str) -> bool:
    """A name outside ragcache: resolved by import for the standard library, by the presence of the
    top-level package otherwise (vLLM, torch and the like are not imported here)."""
    top = dotted.split(".")[0]
    if "." not in dotted and hasattr(builtins, dotted):
        return True
    if top not in sys.stdlib_module_names:
        return importlib.util.find_spec(top) is not None
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def resolve(dotted: str, depth: int = 0) -> bool:
    """Whether the fully qualified ``dotted`` names something."""
    if depth > 10:
        return False
    if dotted.split(".")[0] != "ragcache":
        return _external(dotted)
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        module = ".".join(parts[:i])
        if module in SCOPES:
            return _walk(SCOPES[module], module, parts[i:], depth)
    return False


def _walk(scope: Scope, where: str, rest: list[str], depth: int) -> bool:
    if not rest:
        return True
    head, tail = rest[0], rest[1:]
    if head in scope.members:
        return _walk(scope.members[head], f"{where}.{head}", tail, depth)
    if head in scope.names:
        return not tail or scope.kind == "module" and f"{where}.{head}" in SCOPES
    if head in scope.imports:
        return resolve(".".join([scope.imports[head], *tail]), depth + 1)
    if scope.kind == "module" and f"{where}.{head}" in SCOPES:
        return _walk(SCOPES[f"{where}.{head}"], f"{where}.{head}", tail, depth)
    if scope.kind == "class":
        module = where.rsplit(".", 1)[0]
        while module not in SCOPES and "." in module:
            module = module.rsplit(".", 1)[0]
        for base in scope.bases:
            target = SCOPES[module].imports.get(base.split(".")[0])
            qualified = (target + base[len(base.split(".")[0]):]) if target else f"{module}.{base}"
            if resolve(".".join([qualified, *rest]), depth + 1):
                return True
    return False


def _candidates(target: str, module: str, classes: list[str]) -> list[str]:
    package = module if module in SCOPES and (PACKAGE / Path(*module.split(".")[1:]) / "__init__.py").exists() \
        else module.rsplit(".", 1)[0]
    out = [target]
    for i in range(len(classes), 0, -1):
        out.append(".".join([module, *classes[:i], target]))
    out += [f"{module}.{target}", f"{package}.{target}", f"ragcache.{target}"]
    return out


def _references():
    """``(module, line, role, target, enclosing classes)`` for every reference in a docstring or ``#:`` comment."""
    for module, tree in TREES.items():
        def visit(node: ast.AST, classes: list[str]):
            classes = classes + [node.name] if isinstance(node, ast.ClassDef) else classes  # its own docstring too
            doc = ast.get_docstring(node, clean=False) if isinstance(
                node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) else None
            if doc:
                line = getattr(node, "lineno", 1)
                for m in REF.finditer(doc):
                    yield module, line, m[1], m[2], classes
            for child in ast.iter_child_nodes(node):
                yield from visit(child, classes)
        yield from visit(tree, [])
        path = PACKAGE / Path(*module.split(".")[1:])
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        for no, text in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            if text.lstrip().startswith("#:"):
                for m in REF.finditer(text):
                    yield module, no, m[1], m[2], []


def _target(text: str) -> str:
    m = re.search(r"<([^>]+)>$", text)
    target = re.sub(r"\s+", "", m[1] if m else text).lstrip("~").removesuffix("()")  # a name broken over lines
    return target.lstrip(".")


def test_every_docstring_reference_names_an_existing_symbol():
    refs = list(_references())
    assert len(refs) > 500  # the walk found the package's references
    broken = sorted({f"{module}:{line}: :{role}:`{text}`" for module, line, role, text, classes in refs
                     if not any(resolve(c) for c in _candidates(_target(text), module, classes))})
    assert not broken, "references to nothing:\n" + "\n".join(broken)
