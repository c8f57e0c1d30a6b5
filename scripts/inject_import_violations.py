#!/usr/bin/env python3
"""How many layout violations do the import rules catch? Inject them one at a time and count.

Usage::

    python scripts/inject_import_violations.py [--package SRC] [--contracts SRC] [--out FILE]

SRC is ``worktree`` (the default: the files as they are now) or a git revision (``HEAD``,
``7a51e57``): ``--package`` says where ``shardwise/`` comes from, ``--contracts`` where
``pyproject.toml`` (its ``[tool.importlinter]`` contracts) and ``tests/test_import_contract.py``
(the AST checks) come from. So ``--contracts HEAD`` measures the committed rules and the default
the rules in the working tree, on the same package.

Everything happens in a temporary copy; the repository is never written. In the copy the script
first checks that the unmodified package passes (else nothing can be counted and it exits 2),
then for each violation of VIOLATIONS it appends a few lines to one file (or adds a module),
runs ``lint-imports`` and ``pytest tests/test_import_contract.py`` there (``PYTHONPATH`` points
at the copy, so the copy is what is analysed), records which contracts and tests failed, and
restores the file. A violation is caught when either fails. A violation whose target file does
not exist in the package is reported as skipped.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTRACT_FILES = ("pyproject.toml", "tests/test_import_contract.py")


@dataclass(frozen=True)
class Violation:
    kind: str       # layers | components | registry | rooms | unplaced | collective
    target: str     # file under shardwise/ that receives the code (created when new=True)
    code: str       # appended at the end of the file
    what: str
    new: bool = False


def imp(kind: str, target: str, line: str, what: str) -> Violation:
    return Violation(kind, target, line, what)


DIST = "import torch.distributed as dist\n"
VIOLATIONS = [
    # upward imports between the layers of the package root
    imp("layers", "config/__init__.py", "from shardwise.cli import main", "config (bottom) imports cli"),
    imp("layers", "comm/collectives.py", "from shardwise.mesh import Mesh", "comm imports mesh"),
    imp("layers", "mesh.py", "from shardwise.parallel.base import Strategy",
        "mesh imports a strategy"),
    imp("layers", "memory/amp.py", "def _late():\n    from shardwise.run.train import train",
        "memory imports train inside a function"),
    imp("layers", "parallel/presets.py", "from shardwise.parallel.layout import resolve", "presets imports layout"),
    imp("layers", "config/__init__.py", "from shardwise.parallel.presets import PRESETS", "config imports presets"),
    imp("layers", "comm/p2p.py", "from shardwise.parallel.pipeline import schedule",
        "comm imports the pipeline"),
    imp("layers", "run/metrics.py", "from shardwise.run.train import train",
        "metrics (a small leaf) imports train"),
    imp("layers", "config/writable.py", "from shardwise.checkpoint import store",
        "writable (a small leaf) imports checkpoint"),
    imp("layers", "run/api.py", "from shardwise.run.train import train",
        "the Engine imports the loop (run/ layers)"),
    imp("layers", "launch/torchrun.py", "from shardwise.launch.ranks import train_rank",
        "torchrun imports a rank's entry (launch/ layers)"),
    imp("layers", "run/train.py", "from shardwise.launch import checks",
        "the loop imports the launcher's checks"),
    imp("layers", "checkpoint/state.py", "from shardwise.run import api",
        "checkpoint imports the Engine"),
    imp("layers", "parallel/layout.py", "from shardwise.checkpoint import store",
        "the layout imports checkpoint"),
    imp("rooms", "checkpoint/tools.py", "from shardwise.parallel.data import zero",
        "checkpoint imports a component (ZeRO)"),
    Violation("unplaced", "run/extra_step.py", "from shardwise.config import Config",
              "a new run/ module in no layer", new=True),
    # the leaf rooms: nothing distributed, independent of each other, the planner alone
    imp("rooms", "models/gpt.py", "from shardwise.comm.collectives import Comm",
        "models import comm"),
    imp("rooms", "data/batch.py", "import shardwise.parallel.data.ddp", "data imports DDP"),
    imp("rooms", "planner/cost.py", "import torch", "the planner imports torch"),
    imp("rooms", "planner/cost.py", "from shardwise.config import Config",
        "the planner imports shardwise.config"),
    imp("rooms", "models/gpt.py", "from shardwise.data import batch", "models import data"),
    imp("rooms", "memory/amp.py", "from shardwise.models import gpt", "memory imports models"),
    imp("rooms", "checkpoint/store.py", "from shardwise.parallel.base import Strategy",
        "checkpoint imports a strategy class"),
    # the components of shardwise.parallel never import each other
    imp("components", "parallel/tensor.py",
        "from shardwise.parallel.pipeline.schedule import Action", "tensor imports pipeline"),
    imp("components", "parallel/data/zero.py", "from shardwise.parallel import tensor",
        "ZeRO imports tensor (from shardwise.parallel import X)"),
    imp("components", "parallel/ps.py", "from .data import ddp",
        "ps imports DDP (relative import)"),
    imp("components", "parallel/data/ddp.py", "from ..tensor_loss import vocab_parallel_loss",
        "DDP imports tensor's helper (relative import)"),
    imp("components", "parallel/tensor.py", "from shardwise.parallel.ps_checks import check",
        "tensor imports the parameter server's checks"),
    imp("components", "parallel/tensor_lora.py", "from shardwise.parallel.dp_checks import check",
        "a tensor helper imports dp's checks"),
    imp("components", "parallel/data/zero.py", "import shardwise.parallel.pipeline.schedule as s",
        "ZeRO imports the pipeline (import ... as)"),
    imp("components", "parallel/pipeline/executor.py",
        "def _late():\n    from shardwise.parallel.data import ddp",
        "the pipeline imports DDP inside a function"),
    imp("components", "parallel/pipeline/schedule.py",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from shardwise.parallel.tensor import ColumnParallelLinear",
        "the pipeline imports tensor for type checking"),
    imp("components", "parallel/base.py", "from shardwise.parallel.data import ddp",
        "the strategy base imports a component"),
    imp("components", "parallel/dp.py", "from shardwise.parallel.compose import parallelize",
        "a component imports the composer"),
    imp("components", "parallel/ledger.py", "from shardwise.parallel.tensor import vocab",
        "the base's ledger imports a component"),
    # from shardwise.parallel import X: the registry, for the composers only
    imp("registry", "parallel/pipeline/stage.py", "from shardwise.parallel import strategy_class",
        "the pipeline imports the strategy registry"),
    imp("registry", "parallel/data/ddp.py", "from .. import strategy_class",
        "DDP imports the registry (relative)"),
    imp("registry", "parallel/tensor.py", "import shardwise.parallel as registry",
        "tensor imports the registry package"),
    # a module placed in no layer
    Violation("unplaced", "extra_room.py", "from shardwise.config import Config",
              "a new root module in no layer", new=True),
    Violation("unplaced", "parallel/extra_component.py", "from shardwise.parallel import base",
              "a new parallel module in no layer", new=True),
    # torch.distributed outside comm/, however spelled
    imp("collective", "parallel/data/ddp.py", DIST + "def _sync(x):\n    dist.all_reduce(x)",
        "dist.all_reduce in DDP"),
    imp("collective", "parallel/tensor.py",
        "import torch\ndef _sync(x):\n    torch.distributed.all_reduce(x)",
        "torch.distributed.all_reduce spelled out"),
    imp("collective", "run/train.py",
        "from torch.distributed import all_reduce\ndef _sync(x):\n    all_reduce(x)",
        "from torch.distributed import all_reduce"),
    imp("collective", "mesh.py", "def _bcast(x):\n    dist.broadcast(x, 0)",
        "a broadcast in mesh.py (allowed groups, not data)"),
    imp("collective", "run/runtime.py",
        "import torch.distributed as tdist\ndef _wait():\n    tdist.barrier()",
        "a barrier through another alias"),
    imp("collective", "parallel/pipeline/executor.py", "from torch.distributed import isend",
        "isend imported by name in the pipeline"),
    imp("collective", "checkpoint/store.py",
        DIST + "def _gather(x):\n    dist.all_gather_object([None], x)",
        "all_gather_object in checkpoint/store.py"),
    imp("collective", "parallel/ps.py", DIST + "def _send(x):\n    getattr(dist, 'send')(x, 1)",
        "a send reached through getattr"),
    imp("collective", "models/gpt.py", DIST + "def _rank():\n    return dist.get_rank()",
        "models read the rank from torch.distributed"),
    imp("collective", "memory/offload.py",
        "import importlib\n_d = importlib.import_module('torch.distributed')",
        "torch.distributed through importlib"),
]


def git_files(rev: str, paths: tuple[str, ...], dest: str) -> None:
    """Extract ``paths`` of revision ``rev`` into ``dest``."""
    archive = subprocess.run(["git", "archive", rev, *paths], cwd=REPO, capture_output=True,
                             check=True)
    subprocess.run(["tar", "-x", "-C", dest], input=archive.stdout, check=True)


def materialise(dest: str, package: str, contracts: str) -> None:
    """The package and the contract files, each from the working tree or a revision."""
    if package == "worktree":
        shutil.copytree(os.path.join(REPO, "shardwise"), os.path.join(dest, "shardwise"),
                        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
        git_files(package, ("shardwise",), dest)
    os.makedirs(os.path.join(dest, "tests"), exist_ok=True)
    if contracts == "worktree":
        for rel in CONTRACT_FILES:
            shutil.copy(os.path.join(REPO, rel), os.path.join(dest, rel))
    else:
        git_files(contracts, CONTRACT_FILES, dest)


def check(dest: str) -> dict:
    """Run the contracts and the AST tests in ``dest``: which contracts and tests fail."""
    env = {**os.environ, "PYTHONPATH": dest, "PYTHONDONTWRITEBYTECODE": "1", "COLUMNS": "1000"}
    bindir = os.path.dirname(sys.executable)
    lint = subprocess.run([os.path.join(bindir, "lint-imports"), "--no-cache"], cwd=dest,
                          env=env, capture_output=True, text=True, timeout=300)
    broken = re.findall(r"^(\S.*?) BROKEN\s*$", lint.stdout, re.M)   # one line: COLUMNS
    tests = subprocess.run([sys.executable, "-m", "pytest", "tests/test_import_contract.py", "-q",
                            "-p", "no:cacheprovider", "-o", "addopts=", "-rf",
                            "--rootdir", dest], cwd=dest, env=env, capture_output=True,
                           text=True, timeout=300)
    failed = sorted(set(re.findall(r"^FAILED \S+::(\w+)", tests.stdout, re.M)))
    ast_failed = [t for t in failed if t != "test_import_linter_contracts_are_kept"]
    return {"lint_rc": lint.returncode, "contracts_broken": broken, "tests_failed": failed,
            "caught_by_contracts": lint.returncode != 0, "caught_by_ast": bool(ast_failed),
            "caught": lint.returncode != 0 or tests.returncode != 0,
            "errors": (lint.stdout + lint.stderr)[-1500:] if lint.returncode not in (0, 1)
            else ""}


def inject(dest: str, v: Violation) -> dict:
    """Apply one violation in the copy, check, restore; the outcome."""
    path = os.path.join(dest, "shardwise", v.target)
    if v.new == os.path.exists(path):
        return {"skipped": f"{v.target} {'exists' if v.new else 'is missing'}"}
    original = None if v.new else open(path, encoding="utf-8").read()
    with open(path, "w", encoding="utf-8") as f:
        f.write((original or "") + f"\n\n# injected violation\n{v.code}\n")
    try:
        return check(dest)
    finally:
        if v.new:
            os.remove(path)
        else:
            with open(path, "w", encoding="utf-8") as f:
                f.write(original)


def run(package: str, contracts: str) -> dict:
    with tempfile.TemporaryDirectory(prefix="shardwise-inject-") as dest:
        materialise(dest, package, contracts)
        baseline = check(dest)
        if baseline["caught"]:
            return {"package": package, "contracts": contracts, "baseline": baseline}
        rows = []
        for v in VIOLATIONS:
            outcome = inject(dest, v)
            rows.append({"kind": v.kind, "target": v.target, "what": v.what, **outcome})
            mark = "skip" if "skipped" in outcome else "CAUGHT" if outcome["caught"] else "missed"
            print(f"  {mark:6} {v.kind:10} {v.what}", flush=True)
    counted = [r for r in rows if "skipped" not in r]
    by_kind = {}
    for r in counted:
        k = by_kind.setdefault(r["kind"], [0, 0])
        k[0] += r["caught"]
        k[1] += 1
    return {"package": package, "contracts": contracts, "baseline": baseline,
            "injected": len(counted), "caught": sum(r["caught"] for r in counted),
            "caught_by_contracts": sum(r["caught_by_contracts"] for r in counted),
            "caught_by_ast": sum(r["caught_by_ast"] for r in counted),
            "skipped": len(rows) - len(counted),
            "by_kind": {k: f"{c}/{n}" for k, (c, n) in by_kind.items()}, "violations": rows}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--package", default="worktree",
                        help="where shardwise/ comes from: worktree or a git revision")
    parser.add_argument("--contracts", default="worktree", help="where pyproject.toml and "
                        "tests/test_import_contract.py come from: worktree or a git revision")
    parser.add_argument("--out", help="also write the outcome as JSON to this file")
    args = parser.parse_args(argv)
    print(f"package from {args.package}, contracts from {args.contracts}", flush=True)
    result = run(args.package, args.contracts)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    if "injected" not in result:
        b = result["baseline"]
        print(f"the unmodified package already breaks the rules (contracts broken: "
              f"{b['contracts_broken']}, tests failed: {b['tests_failed']}): nothing to count; "
              f"fix those first or pass --package HEAD", file=sys.stderr)
        return 2
    print(f"caught {result['caught']} of {result['injected']} injected violations "
          f"(contracts: {result['caught_by_contracts']}, AST tests: {result['caught_by_ast']}; "
          f"skipped: {result['skipped']}); by kind: {result['by_kind']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
