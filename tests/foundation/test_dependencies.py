"""Every third-party import in shardwise/ is declared in pyproject.toml or guarded.

Declared: the distribution that provides the module is in ``[project] dependencies``.
Guarded: the import sits in a ``try:`` whose handlers catch ImportError (or
ModuleNotFoundError), so the path that reaches it can say which extra to install
(shardwise/config/extras.py). Anything else would be a traceback on a user's machine that the
development machine, with packages installed by hand, never shows.
"""
from __future__ import annotations

import ast
import os
import re
import sys
import tomllib
from importlib.metadata import packages_distributions

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGE = os.path.join(ROOT, "shardwise")


def declared_distributions() -> set[str]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        project = tomllib.load(fh)["project"]
    names = set()
    for req in project["dependencies"]:
        names.add(re.split(r"[\s<>=!~;\[]", req, maxsplit=1)[0].lower().replace("_", "-"))
    return names


def _guarded(node: ast.AST, parents: dict) -> bool:
    while node in parents:
        node, child = parents[node], node
        if isinstance(node, ast.Try) and child in node.body:
            for handler in node.handlers:
                caught = handler.type
                names = [caught] if not isinstance(caught, ast.Tuple) else list(caught.elts)
                if any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError")
                       for n in names):
                    return True
    return False


def third_party_imports() -> list[tuple[str, int, str, bool]]:
    """(file, line, top-level module, guarded) for every import of a non-stdlib, non-shardwise
    module in shardwise/."""
    found = []
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(folder, name)
            tree = ast.parse(open(path).read(), path)
            parents = {child: parent for parent in ast.walk(tree) for child in ast.iter_child_nodes(parent)}
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    modules = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for module in modules:
                    top = module.split(".")[0]
                    if top == "shardwise" or top in sys.stdlib_module_names or top == "__future__":
                        continue
                    found.append((os.path.relpath(path, ROOT), node.lineno, top, _guarded(node, parents)))
    return found


def test_every_third_party_import_is_declared_or_guarded():
    declared = declared_distributions()
    providers = packages_distributions()
    bad = []
    for path, line, top, guarded in third_party_imports():
        dists = {d.lower().replace("_", "-") for d in providers.get(top, [top])}
        if not (dists & declared) and not guarded:
            bad.append(f"{path}:{line}: import {top} (distribution {sorted(dists)})")
    assert not bad, ("imports that are neither a base dependency in pyproject.toml nor inside "
                     "try/except ImportError:\n" + "\n".join(bad))


def test_the_scan_sees_imports():
    """The check above must be able to fail: it finds torch, and finds no guard around it."""
    hits = [(p, top, g) for p, _, top, g in third_party_imports()]
    assert any(top == "torch" and not g for _, top, g in hits)
    assert "torch" in declared_distributions()


def test_a_guarded_import_is_recognised():
    tree = ast.parse("try:\n    import tensorboard\nexcept ImportError:\n    pass\nimport other\n")
    parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    imports = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Import)), key=lambda n: n.lineno)
    assert [_guarded(n, parents) for n in imports] == [True, False]
