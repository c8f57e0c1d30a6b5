"""The layout's import rules (docs/DESIGN.md): import-linter's contracts in pyproject.toml, plus
the one rule import-linter cannot express: which torch.distributed names a file outside comm/
may use (import-linter sees only the top-level package ``torch``).

The contracts place every entry of the package root and every module of shardwise.parallel in a
layer (``exhaustive``), keep the parallel components and their helpers independent, keep
``from shardwise.parallel import X`` (the strategy registry) to the composers, and keep the leaf
rooms free of anything distributed. scripts/inject_import_violations.py injects violations one
at a time into a copy of the package and counts how many this file catches.
"""
import ast
import os
import pathlib
import re
import subprocess
import sys
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1] / "shardwise"
TD = "torch.distributed"

# torch.distributed names a file outside comm/ may use, with the reason. A use is a name read
# from the module (``dist.new_group``, ``torch.distributed.new_group``, ``from
# torch.distributed import new_group``) or a submodule imported; the bare ``import
# torch.distributed [as dist]`` is no use by itself. Anything else, collectives first, is refused.
ALLOWED = [
    ("", ("is_available", "is_initialized", "get_rank", "get_world_size", "get_backend"),
     "they read the world's state; no data moves"),
    ("mesh.py", ("new_group", "group.WORLD"),
     "the mesh creates one process group per axis (every rank, same order) and wraps the world"),
    ("run/runtime.py", ("init_process_group", "destroy_process_group", "group.WORLD"),
     "it starts and ends the world (and reads the NCCL world group's bound device)"),
    ("launch/world.py", ("init_process_group", "destroy_process_group", "barrier"),
     "the test harness's forked gloo world: one barrier so no rank tears down while another talks"),
    ("checkpoint/dcp_io.py", ("checkpoint", "new_group"),
     "the one door to torch.distributed.checkpoint, over a gloo group made for it"),
    ("bench/", ("init_process_group", "fsdp", "device_mesh", "tensor", "pipelining",
                "optim", "algorithms._checkpoint"),
     "the PyTorch peers the benchmarks measure shardwise against (FSDP2, DTensor TP, "
     "torch.distributed.pipelining, ZeroRedundancyOptimizer) and a GPU world of their own"),
]
# rooms that use nothing of torch.distributed, not even an import or a query
NOTHING_DISTRIBUTED = ("models/", "data/", "planner/")


def torch_aliases(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch module or object it is bound to (``dist`` -> torch.distributed)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == "torch":
                    out[a.asname or "torch"] = a.name if a.asname else "torch"
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module \
                and node.module.split(".")[0] == "torch":
            for a in node.names:
                out[a.asname or a.name] = f"{node.module}.{a.name}"
    return out


def dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """``dist.group.WORLD`` -> "torch.distributed.group.WORLD" through the aliases; else None."""
    if isinstance(node, ast.Name):
        return aliases.get(node.id)
    if isinstance(node, ast.Attribute):
        head = dotted(node.value, aliases)
        return f"{head}.{node.attr}" if head else None
    return None


def distributed_uses(source: str) -> list[tuple[int, str]]:
    """(line, dotted name) of every torch.distributed use in ``source``; the plain ``import
    torch.distributed`` appears as (line, "import torch.distributed")."""
    tree = ast.parse(source)
    aliases = torch_aliases(tree)
    parents = {id(c): p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
    found = []
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name if a.name != TD else f"import {TD}" for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            names = [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, (ast.Name, ast.Attribute)) \
                and not isinstance(parents.get(id(node)), ast.Attribute):
            names = [dotted(node, aliases) or ""]     # the longest chain only
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and (dotted(node.func, {"importlib": "importlib"}) == "importlib.import_module"
                     or isinstance(node.func, ast.Name) and node.func.id == "__import__"):
            names = [str(node.args[0].value)]
        found += [(node.lineno, n) for n in names
                  if n == TD or n.startswith(TD + ".") or n == f"import {TD}"]
    return sorted(set(found))


def refused(rel: str, use: str) -> bool:
    """Whether file ``rel`` (relative to shardwise/, '/'-separated) may not use ``use``."""
    if rel.startswith("comm/"):
        return False
    if rel.startswith(NOTHING_DISTRIBUTED):
        return True
    if use == f"import {TD}":
        return False
    for where, names, _why in ALLOWED:
        if rel.startswith(where) and any(use == f"{TD}.{n}" or use.startswith(f"{TD}.{n}.")
                                         for n in names):
            return False
    return True


def test_import_linter_contracts_are_kept():
    """Every contract of pyproject.toml is kept (layers, independence, registry, leaf rooms)."""
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([exe], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    with open(ROOT.parent / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    kept = re.search(r"Contracts: (\d+) kept, 0 broken", done.stdout)
    assert kept and int(kept.group(1)) == len(contracts), done.stdout[-2000:]


def test_every_root_entry_and_parallel_module_is_in_a_layer():
    """The two layers contracts are exhaustive: a module placed in no layer breaks them."""
    with open(ROOT.parent / "pyproject.toml", "rb") as f:
        contracts = tomllib.load(f)["tool"]["importlinter"]["contracts"]
    exhaustive = {c for k in contracts if k["type"] == "layers" and k.get("exhaustive")
                  for c in k.get("containers", [])}
    assert {"shardwise", "shardwise.parallel"} <= exhaustive, exhaustive


@pytest.mark.parametrize("source, use", [
    ("import torch.distributed as dist\ndist.all_reduce(x)", f"{TD}.all_reduce"),
    ("import torch\ntorch.distributed.all_reduce(x)", f"{TD}.all_reduce"),
    ("import torch.distributed\ntorch.distributed.broadcast(x, 0)", f"{TD}.broadcast"),
    ("from torch.distributed import all_reduce as ar\nar(x)", f"{TD}.all_reduce"),
    ("from torch import distributed as d\nd.isend(x, 1)", f"{TD}.isend"),
    ("import torch.distributed as tdist\ngetattr(tdist, 'barrier')()", TD),
    ("import importlib\nimportlib.import_module('torch.distributed.fsdp')", f"{TD}.fsdp"),
    ("def f(x):\n    import torch.distributed as dist\n    dist.reduce_scatter_tensor(x, x)",
     f"{TD}.reduce_scatter_tensor"),
])
def test_distributed_uses_are_found_however_spelled(source, use):
    """Aliased, spelled out, imported by name, reached by getattr or importlib: each is seen,
    and refused outside comm/ for a training file."""
    uses = [u for _, u in distributed_uses(source)]
    assert use in uses, uses
    assert refused("parallel/tensor.py", use)
    assert not refused("comm/collectives.py", use)


def test_allowed_uses_are_the_listed_ones_only():
    assert not refused("mesh.py", f"{TD}.new_group")
    assert refused("mesh.py", f"{TD}.broadcast")
    assert not refused("train.py", f"{TD}.get_rank") and not refused("train.py", f"import {TD}")
    assert refused("models/gpt.py", f"import {TD}") and refused("data/loader.py", f"{TD}.get_rank")
    assert not refused("checkpoint/dcp_io.py", f"{TD}.checkpoint.save")
    assert refused("checkpoint/store.py", f"{TD}.checkpoint.save")


def test_torch_distributed_only_in_comm():
    """Outside comm/ a file uses only the torch.distributed names ALLOWED lists for it; models/,
    data/ and planner/ use none. Collectives (however spelled) live in comm/."""
    bad = []
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        bad += [f"{rel}:{line} {use}" for line, use in distributed_uses(path.read_text())
                if refused(rel, use)]
    assert not bad, ("torch.distributed used outside comm/ (move the call into shardwise/comm/, "
                     "or add it to ALLOWED with the reason):\n" + "\n".join(bad))
