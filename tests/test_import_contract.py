"""The layout's import rules (docs/DESIGN.md): import-linter's contracts in pyproject.toml, plus
what import-linter cannot express (torch.distributed calls outside comm/, strategy families)."""
import ast
import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1] / "shardwise"
COLLECTIVE = re.compile(r"\bdist\.(all_reduce|all_gather\w*|reduce_scatter\w*|broadcast|send|recv|"
                        r"isend|irecv|barrier|batch_isend_irecv|all_to_all\w*)\(")


def imports_of(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def modules(sub: str = ""):
    return sorted((ROOT / sub).rglob("*.py"))


def test_import_linter_contracts_are_kept():
    """Layers, independence of the leaf rooms, nothing distributed below (pyproject.toml)."""
    exe = os.path.join(os.path.dirname(sys.executable), "lint-imports")
    done = subprocess.run([exe], cwd=ROOT.parent, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert re.search(r"Contracts: (\d+) kept, 0 broken", done.stdout)
    assert int(re.search(r"Contracts: (\d+) kept", done.stdout).group(1)) >= 4


def test_planner_and_models_import_nothing_distributed():
    for path in modules("planner"):
        bad = {m for m in imports_of(path) if m.split(".")[0] == "torch" or
               (m.startswith("shardwise") and not m.startswith("shardwise.planner"))}
        assert not bad, f"{path.name} imports {bad}"
    for path in modules("models") + modules("data"):
        bad = {m for m in imports_of(path) if "distributed" in m or m.startswith("shardwise.parallel")
               or m.startswith("shardwise.comm")}
        assert not bad, f"{path.name} imports {bad}"


def test_comm_and_memory_know_no_strategy():
    for sub in ("comm", "memory"):
        for path in modules(sub):
            bad = {m for m in imports_of(path) if m.startswith("shardwise.parallel")
                   or m.startswith("shardwise.train")}
            assert not bad, f"{sub}/{path.name} imports {bad}"


def test_strategies_do_not_import_each_other():
    """A strategy file imports only base.py and its own family (zero*.py; a sub-package such as
    data/ or pipeline/ counts as one family); only the composers (compose.py, hybrid.py) and the
    registries (__init__.py) combine them."""
    composer = {"hybrid.py", "__init__.py", "base.py", "compose.py"}
    for path in modules("parallel"):
        nested = path.parent.name != "parallel"
        if path.name in composer and not nested:
            continue
        own = path.parent.name if nested else path.stem.split("_")[0]
        for m in imports_of(path):
            if m.startswith("shardwise.parallel.") and m != "shardwise.parallel.base":
                other = m.split(".")[2] if nested else m.split(".")[2].split("_")[0]
                assert other == own, f"parallel/{path.relative_to(ROOT / 'parallel')} imports {m}"


def test_collectives_only_in_comm():
    for path in modules():
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "comm" or path.name == "testing.py":
            continue
        hits = COLLECTIVE.findall(path.read_text())
        assert not hits, f"{rel} calls torch.distributed collectives directly: {hits}"
