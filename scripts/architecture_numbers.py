#!/usr/bin/env python3
"""The architecture's numbers (issue 28), measured from the source with ``ast`` and ``git``.

Usage::

    python scripts/architecture_numbers.py [--root REPO] [--package shardwise] [--rev REV]
                                           [--out FILE]

prints one line per number (and the files behind it) and, with ``--out``, writes them as JSON
together with the commit, whether the tree was dirty and the dates. ``--rev REV`` measures a
commit instead of the working tree (its files, from ``git archive``, in a temporary folder). Nothing is imported: every
number comes from parsing the files, so it runs without torch and on a broken tree.

Definitions (``PKG`` is the package folder, ``REPO`` the repository root):

stages (classes and files per ZeRO stage)
    The stage classes are the values of ``STRATEGY_CLASSES`` in ``PKG/parallel/__init__.py``
    whose key is ``zero<N>`` (``"module:Class"`` strings). A stage's classes are the stage class
    and its ancestors (C3 order, like ``__mro__``) restricted to classes defined in PKG: a base
    is resolved through the module's own classes and its imports (absolute, relative, aliased,
    re-exported); bases from outside PKG (``object``, ``nn.Module``) are dropped. Its files are
    the distinct files those classes are defined in.
zero2_tower (methods of the ZeRO-2 class tower)
    ``methods``: the ``def`` statements directly in the bodies of the ZeRO-2 stage's classes
    (properties and static methods included, nested functions not). ``names_defined_more_than_once``:
    the method names defined in more than one class of the tower (an override or a shadowing:
    the reader must find which one wins).
strategy_name_files (files outside the strategies' own components that spell strategy names)
    Strategy names: the keys of ``STRATEGY_CLASSES`` (ddp, dp, zero1-3, tp, pp, 3d, ps, single).
    A file spells one when it holds a string literal equal to a name (docstrings excluded;
    f-string pieces and longer strings do not count). Files under ``PKG/parallel/`` (the
    strategies, their checks and the registry) are their own components and are not counted.
long_functions (functions over 50 lines)
    Every ``def`` in PKG (methods and nested functions included) whose span from the ``def``
    line to its last line (decorators excluded, docstring included) exceeds 50 lines.
big_constructors (constructors over 6 arguments)
    Every ``__init__`` in PKG whose parameters, ``self`` excluded, number more than 6:
    positional-only + positional + keyword-only, plus one each for ``*args`` and ``**kwargs``.
root_entries (entries at the package root)
    Modules ``PKG/*.py`` other than ``__init__.py`` plus packages (folders holding an
    ``__init__.py``). Other files and folders (data, caches) are listed apart and not counted.
unlayered (modules in no import-linter layer)
    A root entry is layered when it, or a package that contains it, is a layer (or one of the
    ``|`` / ``:`` siblings of a layer) of a ``layers`` contract in ``[tool.importlinter]`` of
    ``REPO/pyproject.toml``, a layer name being joined to each of the contract's ``containers``.
    ``in_no_contract``: the root entries that no contract of any type names.
seed_references ("seed 00X" references)
    Matches of ``seeds? 0NN`` (case-insensitive, three digits starting with 0) in the files git
    tracks (all files under REPO outside a git checkout), by file and by area (the package,
    docs/, tests/, everything else).
new_axis_files (the files a new mesh axis would touch)
    The axis names are ``AXES`` in ``PKG/mesh.py`` (default pp, dp, tp: the order
    ``PKG/config/names.py`` defines and mesh.py imports). A file of PKG is
    touched when it (a) holds a string literal equal to an axis name (docstrings excluded): a
    mesh lookup, a group name, a size mapping key; or (b) reads an attribute named like an axis
    (``cfg.parallel.tp``, ``mesh.pp``); or (c) uses a per-axis identifier ``<axis>_size``,
    ``<axis>_rank``, ``<axis>_group`` or ``<axis>_groups`` (a name, an attribute, an argument or
    a keyword). Each file lists which of (a), (b), (c) it matched; ``count`` is the files with
    any of them, ``count_ab`` those with (a) or (b) alone.
"""
from __future__ import annotations

import argparse
import ast
import datetime
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
from collections import Counter
from dataclasses import dataclass, field

LONG_FUNCTION_LINES = 50
BIG_CONSTRUCTOR_ARGS = 6
DEFAULT_STRATEGIES = ("single", "ddp", "dp", "zero1", "zero2", "zero3", "tp", "pp", "3d", "ps")
DEFAULT_AXES = ("pp", "dp", "tp")
SEED = re.compile(r"\bseeds?\s+0\d\d\b", re.IGNORECASE)


# ---------------------------------------------------------------------------------------------
# the package as parsed modules
# ---------------------------------------------------------------------------------------------
@dataclass
class Module:
    name: str          # dotted, "shardwise.parallel.data.zero"; a package is its __init__
    path: str          # relative to the repository root
    tree: ast.Module
    is_package: bool
    imports: dict[str, str] = field(default_factory=dict)   # local name -> dotted target


def load_package(root: str, package: str) -> dict[str, Module]:
    """Every .py file under ``root/package``, parsed, keyed by dotted module name."""
    modules = {}
    base = os.path.join(root, package)
    for folder, dirs, files in os.walk(base):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(f for f in files if f.endswith(".py")):
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            parts = rel[:-3].split(os.sep)
            is_package = parts[-1] == "__init__"
            dotted = ".".join(parts[:-1] if is_package else parts)
            with open(path, encoding="utf-8") as f:
                tree = ast.parse(f.read(), filename=rel)
            module = Module(dotted, rel, tree, is_package)
            module.imports = import_table(module)
            modules[dotted] = module
    return modules


def resolve_relative(module: Module, level: int, target: str | None) -> str:
    """The absolute name of ``from <level dots><target> import ...`` inside ``module``."""
    parts = module.name.split(".")
    if not module.is_package:
        parts = parts[:-1]
    parts = parts[: len(parts) - (level - 1)] if level > 1 else parts
    return ".".join(parts + ([target] if target else []))


def import_table(module: Module) -> dict[str, str]:
    """Local name -> dotted name it is bound to, for every import anywhere in the module."""
    table = {}
    for node in ast.walk(module.tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname:
                    table[alias.asname] = alias.name
                else:
                    head = alias.name.split(".")[0]
                    table[head] = head
        elif isinstance(node, ast.ImportFrom):
            source = resolve_relative(module, node.level, node.module) if node.level \
                else node.module
            for alias in node.names:
                table[alias.asname or alias.name] = f"{source}.{alias.name}"
    return table


def docstring_nodes(tree: ast.AST) -> set[int]:
    """ids of the string constants that are docstrings (module, class, function)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant) \
                    and isinstance(body[0].value.value, str):
                out.add(id(body[0].value))
    return out


def string_literals(tree: ast.AST) -> set[str]:
    """The values of the string constants outside docstrings and f-strings."""
    skip = docstring_nodes(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            skip.update(id(v) for v in node.values)
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
            and isinstance(n.value, str) and id(n) not in skip}


# ---------------------------------------------------------------------------------------------
# classes: resolution of bases and the restricted MRO
# ---------------------------------------------------------------------------------------------
def class_index(modules: dict[str, Module]) -> dict[str, tuple[Module, ast.ClassDef]]:
    """"module.Class" -> (module, node) for every top-level class of the package."""
    return {f"{m.name}.{n.name}": (m, n) for m in modules.values() for n in m.tree.body
            if isinstance(n, ast.ClassDef)}


def resolve_name(dotted: str, modules: dict[str, Module], classes: dict, depth: int = 0):
    """The package class ``dotted`` names ("mod.Class"), following re-exports; else None."""
    if dotted in classes:
        return dotted
    owner, _, attr = dotted.rpartition(".")
    if depth > 10 or owner not in modules:
        return None
    target = modules[owner].imports.get(attr)
    return resolve_name(target, modules, classes, depth + 1) if target else None


def expression_name(node: ast.expr) -> str | None:
    """``a.b.C`` -> "a.b.C"; ``C`` -> "C"; anything else (a call, a subscript) -> None."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = expression_name(node.value)
        return f"{head}.{node.attr}" if head else None
    return None


def bases_of(key: str, modules: dict[str, Module], classes: dict) -> list[str]:
    """The package classes among the direct bases of class ``key``, in order."""
    module, node = classes[key]
    out = []
    for base in node.bases:
        name = expression_name(base)
        if not name:
            continue
        head, _, rest = name.partition(".")
        if f"{module.name}.{head}" in classes and not rest:
            dotted = f"{module.name}.{head}"
        elif head in module.imports:
            dotted = module.imports[head] + (f".{rest}" if rest else "")
        else:
            continue
        found = resolve_name(dotted, modules, classes)
        if found:
            out.append(found)
    return out


def c3(key: str, modules: dict[str, Module], classes: dict) -> list[str]:
    """C3 linearisation of ``key`` over package classes (``__mro__`` without outside classes)."""
    sequences = [c3(b, modules, classes) for b in bases_of(key, modules, classes)]
    sequences.append(bases_of(key, modules, classes))
    out = [key]
    while any(sequences):
        sequences = [s for s in sequences if s]
        for seq in sequences:
            head = seq[0]
            if not any(head in s[1:] for s in sequences):
                break
        else:   # inconsistent hierarchy: Python would refuse it; keep a depth-first order
            head = sequences[0][0]
        out.append(head)
        sequences = [[c for c in s if c != head] for s in sequences]
    return out


def strategy_registry(modules: dict[str, Module], package: str) -> dict[str, str]:
    """``STRATEGY_CLASSES`` of ``PKG/parallel/__init__.py`` as {name: "module.Class"}."""
    registry = modules.get(f"{package}.parallel")
    if registry is None:
        return {}
    for node in registry.tree.body:
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, ast.AnnAssign) else []
        if any(isinstance(t, ast.Name) and t.id == "STRATEGY_CLASSES" for t in targets) \
                and isinstance(node.value, ast.Dict):
            return {k.value: v.value.replace(":", ".") for k, v in
                    zip(node.value.keys, node.value.values)
                    if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}
    return {}


# ---------------------------------------------------------------------------------------------
# the numbers
# ---------------------------------------------------------------------------------------------
def zero_stages(modules, classes, registry) -> dict:
    """Classes (restricted MRO) and files per ZeRO stage."""
    out = {}
    for name, target in sorted(registry.items()):
        match = re.fullmatch(r"zero(\d)", name)
        key = resolve_name(target, modules, classes) if match else None
        if key is None:
            continue
        tower = c3(key, modules, classes)
        files = sorted({classes[c][0].path for c in tower})
        out[match.group(1)] = {"class": target, "classes": tower, "num_classes": len(tower),
                               "files": files, "num_files": len(files)}
    return out


def tower_methods(classes, tower: list[str]) -> dict:
    """Methods of a class tower and the names defined in more than one of its classes."""
    per_class = {c: [n.name for n in classes[c][1].body
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))] for c in tower}
    seen = Counter(name for names in per_class.values() for name in set(names))
    repeated = sorted(n for n, k in seen.items() if k > 1)
    return {"classes": len(tower), "methods": sum(len(v) for v in per_class.values()),
            "names_defined_more_than_once": len(repeated), "repeated_names": repeated}


def strategy_name_files(modules, package: str, names) -> dict:
    """Files outside PKG/parallel/ holding a string literal equal to a strategy name."""
    own = os.path.join(package, "parallel") + os.sep
    files = {}
    for m in modules.values():
        if m.path.startswith(own):
            continue
        hits = sorted(string_literals(m.tree) & set(names))
        if hits:
            files[m.path] = hits
    return {"names": sorted(names), "count": len(files), "by_entry": by_entry(files, package),
            "files": dict(sorted(files.items()))}


def by_entry(files, package: str) -> dict[str, int]:
    """How many of ``files`` lie under each root entry of PKG (``bench``, ``config.py``)."""
    return dict(sorted(Counter(os.path.relpath(f, package).split(os.sep)[0] for f in files)
                       .items()))


def long_functions(modules) -> dict:
    """Every def whose span (def line to last line) exceeds LONG_FUNCTION_LINES."""
    rows = []
    for m in modules.values():
        for node in ast.walk(m.tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > LONG_FUNCTION_LINES:
                    rows.append({"file": m.path, "line": node.lineno, "name": node.name,
                                 "lines": lines})
    rows.sort(key=lambda r: (-r["lines"], r["file"], r["line"]))
    return {"threshold": LONG_FUNCTION_LINES, "count": len(rows), "functions": rows}


def constructor_arity(node: ast.FunctionDef) -> int:
    """Parameters of an __init__ without self; *args and **kwargs count one each."""
    a = node.args
    named = len(a.posonlyargs) + len(a.args) + len(a.kwonlyargs)
    return named - 1 + (a.vararg is not None) + (a.kwarg is not None)


def big_constructors(modules) -> dict:
    """Every __init__ taking more than BIG_CONSTRUCTOR_ARGS arguments besides self."""
    rows = []
    for m in modules.values():
        for cls in ast.walk(m.tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if isinstance(node, ast.FunctionDef) and node.name == "__init__" \
                        and constructor_arity(node) > BIG_CONSTRUCTOR_ARGS:
                    rows.append({"file": m.path, "line": node.lineno, "class": cls.name,
                                 "arguments": constructor_arity(node)})
    rows.sort(key=lambda r: (-r["arguments"], r["file"], r["line"]))
    return {"threshold": BIG_CONSTRUCTOR_ARGS, "count": len(rows), "constructors": rows}


def root_entries(root: str, package: str) -> dict:
    """Modules and packages directly in PKG (other entries listed apart)."""
    base = os.path.join(root, package)
    modules, packages, other = [], [], []
    for name in sorted(os.listdir(base)):
        path = os.path.join(base, name)
        if name in ("__init__.py", "__pycache__"):
            continue
        if name.endswith(".py") and os.path.isfile(path):
            modules.append(name[:-3])
        elif os.path.isfile(os.path.join(path, "__init__.py")):
            packages.append(name)
        else:
            other.append(name)
    return {"count": len(modules) + len(packages), "modules": modules, "packages": packages,
            "not_counted": other}


def layer_names(contract: dict) -> set[str]:
    """Every module a layers contract places in a layer, containers applied."""
    tails = set()
    for layer in contract.get("layers", []):
        for tail in re.split(r"[|:]", layer):
            tails.add(tail.strip().strip("()").strip())
    containers = contract.get("containers") or [""]
    return {f"{c}.{t}" if c else t for c in containers for t in tails if t}


def contract_names(contract: dict) -> set[str]:
    """Every module a contract of any type names (wildcards kept as written)."""
    out = set()
    for key, value in contract.items():
        if key in ("name", "type", "layers", "containers", "ignore_imports"):
            continue
        if isinstance(value, list):
            out.update(v for v in value if isinstance(v, str))
    return out | layer_names(contract)


def covered(module: str, names: set[str]) -> bool:
    """``module`` is one of ``names``, inside one of them, or matched by a wildcard."""
    for name in names:
        if module == name or module.startswith(name + "."):
            return True
        if "*" in name and re.fullmatch(
                re.escape(name).replace(r"\*\*", ".+").replace(r"\*", "[^.]+"), module):
            return True
    return False


def unlayered(root: str, package: str, entries: dict) -> dict:
    """Root entries in no layer of a layers contract, and in no contract at all."""
    path = os.path.join(root, "pyproject.toml")
    contracts = []
    if os.path.exists(path):
        with open(path, "rb") as f:
            linter = tomllib.load(f).get("tool", {}).get("importlinter", {})
        contracts = linter.get("contracts", [])
    layered = set().union(*(layer_names(c) for c in contracts if c.get("type") == "layers"))
    named = set().union(*(contract_names(c) for c in contracts))
    everything = [f"{package}.{e}" for e in entries["modules"] + entries["packages"]]
    out_of_layers = [m for m in everything if not covered(m, layered)]
    return {"root_entries": len(everything), "count": len(out_of_layers),
            "modules": out_of_layers, "contracts": len(contracts),
            "in_no_contract": [m for m in everything if not covered(m, named)]}


def tracked_files(root: str) -> list[str]:
    """Files git tracks under root; every file (outside .git) when root is not a checkout."""
    done = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True)
    if done.returncode == 0:
        return sorted(p for p in done.stdout.decode().split("\0") if p)
    out = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in (".git", "__pycache__")]
        out += [os.path.relpath(os.path.join(folder, f), root) for f in files]
    return sorted(out)


def seed_references(root: str, package: str) -> dict:
    """Matches of "seed 0NN" per file and per area."""
    files, areas = {}, Counter()
    for rel in tracked_files(root):
        try:
            with open(os.path.join(root, rel), encoding="utf-8") as f:
                hits = len(SEED.findall(f.read()))
        except (UnicodeDecodeError, OSError):
            continue
        if hits:
            files[rel] = hits
            top = rel.split("/")[0]
            areas[top if top in (package, "docs", "tests") else "other"] += hits
    return {"count": sum(files.values()), "num_files": len(files), "by_area": dict(areas),
            "files": files}


def mesh_axes(modules, package: str) -> tuple[str, ...]:
    """``AXES`` of PKG/mesh.py, else the default (pp, dp, tp)."""
    mesh = modules.get(f"{package}.mesh")
    for node in mesh.tree.body if mesh else []:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "AXES"
                                                for t in node.targets):
            try:
                return tuple(ast.literal_eval(node.value))
            except ValueError:
                break
    return DEFAULT_AXES


def axis_reasons(module: Module, axes) -> list[str]:
    """Which of (a) axis string, (b) axis attribute, (c) per-axis identifier a module has."""
    per_axis = re.compile(rf"({'|'.join(map(re.escape, axes))})_(size|rank|groups?)")
    reasons = set()
    if string_literals(module.tree) & set(axes):
        reasons.add("a")
    for node in ast.walk(module.tree):
        ident = node.attr if isinstance(node, ast.Attribute) else node.id \
            if isinstance(node, ast.Name) else node.arg if isinstance(node, (ast.arg, ast.keyword)) \
            else None
        if not ident:
            continue
        if isinstance(node, ast.Attribute) and ident in axes:
            reasons.add("b")
        if per_axis.fullmatch(ident):
            reasons.add("c")
    return sorted(reasons)


def new_axis_files(modules, package: str) -> dict:
    """Files of PKG that spell the axes as strings, read axis attributes or per-axis names."""
    axes = mesh_axes(modules, package)
    files = {m.path: r for m in modules.values() if (r := axis_reasons(m, axes))}
    return {"axes": list(axes), "count": len(files), "by_entry": by_entry(files, package),
            "count_ab": sum(1 for r in files.values() if set(r) & {"a", "b"}),
            "files": dict(sorted(files.items()))}


# ---------------------------------------------------------------------------------------------
# provenance, report, command line
# ---------------------------------------------------------------------------------------------
def git(root: str, *args: str) -> str | None:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def provenance(root: str, package: str) -> dict:
    """Commit, dirty flag (the package or pyproject.toml differ from it) and dates."""
    status = git(root, "status", "--porcelain", "--", package, "pyproject.toml")
    return {"commit": git(root, "rev-parse", "HEAD"),
            "dirty": bool(status) if status is not None else None,
            "commit_date": git(root, "log", "-1", "--format=%cI"),
            "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds")}


def measure_revision(root: str, package: str, rev: str) -> dict:
    """The numbers of commit ``rev``: its tracked files extracted into a temporary folder."""
    commit = git(root, "rev-parse", "--verify", f"{rev}^{{commit}}")
    if commit is None:
        raise ValueError(f"--rev {rev!r} is not a commit of {root}")
    with tempfile.TemporaryDirectory(prefix="architecture-numbers-") as tmp:
        archive = subprocess.run(["git", "archive", commit], cwd=root, capture_output=True,
                                 check=True)
        subprocess.run(["tar", "-x", "-C", tmp], input=archive.stdout, check=True)
        numbers = measure(tmp, package)
    return {**numbers, "commit": commit, "dirty": False,
            "commit_date": git(root, "log", "-1", "--format=%cI", commit)}


def measure(root: str, package: str) -> dict:
    """Every number of the module docstring, as one JSON-ready dict."""
    modules = load_package(root, package)
    classes = class_index(modules)
    registry = strategy_registry(modules, package)
    stages = zero_stages(modules, classes, registry)
    entries = root_entries(root, package)
    return {
        **provenance(root, package),
        "package": package, "files": len(modules), "classes": len(classes),
        "stages": stages,
        "zero2_tower": tower_methods(classes, stages["2"]["classes"]) if "2" in stages else None,
        "strategy_name_files": strategy_name_files(modules, package,
                                                   registry or DEFAULT_STRATEGIES),
        "long_functions": long_functions(modules),
        "big_constructors": big_constructors(modules),
        "root_entries": entries,
        "unlayered": unlayered(root, package, entries),
        "seed_references": seed_references(root, package),
        "new_axis_files": new_axis_files(modules, package),
    }


def summary(n: dict) -> list[str]:
    """The numbers as lines of text, each followed by what is behind it."""
    lines = [f"commit {n['commit']} (dirty: {n['dirty']}), {n['files']} files, "
             f"{n['classes']} classes"]
    for stage, s in n["stages"].items():
        lines.append(f"ZeRO-{stage}: {s['num_classes']} classes in {s['num_files']} files "
                     f"({', '.join(c.rsplit('.', 1)[1] for c in s['classes'])})")
    if n["zero2_tower"]:
        t = n["zero2_tower"]
        lines.append(f"ZeRO-2 tower: {t['methods']} methods, {t['names_defined_more_than_once']}"
                     f" names defined more than once ({', '.join(t['repeated_names'])})")
    s = n["strategy_name_files"]
    lines.append(f"files outside parallel/ spelling strategy names: {s['count']} "
                 f"(per root entry: {s['by_entry']})")
    lines += [f"  {f}: {', '.join(h)}" for f, h in s["files"].items()]
    f = n["long_functions"]
    lines.append(f"functions over {f['threshold']} lines: {f['count']}")
    lines += [f"  {r['file']}:{r['line']} {r['name']} ({r['lines']})" for r in f["functions"]]
    c = n["big_constructors"]
    lines.append(f"constructors over {c['threshold']} arguments: {c['count']}")
    lines += [f"  {r['file']}:{r['line']} {r['class']} ({r['arguments']})"
              for r in c["constructors"]]
    r = n["root_entries"]
    lines.append(f"root entries: {r['count']} ({len(r['modules'])} modules, "
                 f"{len(r['packages'])} packages)")
    u = n["unlayered"]
    lines.append(f"root entries in no import-linter layer: {u['count']} of {u['root_entries']}"
                 f" ({', '.join(u['modules'])}); in no contract: {len(u['in_no_contract'])}")
    sd = n["seed_references"]
    lines.append(f"'seed 0NN' references: {sd['count']} in {sd['num_files']} files {sd['by_area']}")
    a = n["new_axis_files"]
    lines.append(f"files a new mesh axis would touch: {a['count']} (strings or axis attributes: "
                 f"{a['count_ab']}; per root entry: {a['by_entry']})")
    lines += [f"  {p}: {''.join(rs)}" for p, rs in a["files"].items()]
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), help="repository root (default: this script's repository)")
    parser.add_argument("--package", default="shardwise", help="package folder under the root")
    parser.add_argument("--rev", help="measure this commit instead of the working tree")
    parser.add_argument("--out", help="also write the numbers as JSON to this file")
    args = parser.parse_args(argv)
    if not os.path.isdir(os.path.join(args.root, args.package)):
        print(f"architecture_numbers: no package folder {args.package!r} under --root "
              f"{args.root!r}; pass --root REPO --package NAME", file=sys.stderr)
        return 2
    try:
        numbers = measure_revision(args.root, args.package, args.rev) if args.rev \
            else measure(args.root, args.package)
    except ValueError as e:
        print(f"architecture_numbers: {e}; pass a commit, branch or tag", file=sys.stderr)
        return 2
    print("\n".join(summary(numbers)))
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(numbers, f, indent=1)
            f.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
