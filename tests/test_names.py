"""Strategy and axis names are spelled once (shardwise/config/names.py) and everything agrees
with that one spelling: the registry of components, the mesh, the CLI's choices, the planner.

The last test is the contract of issue 28 item 4: outside the components (``parallel/``), at
most 3 files spell a strategy name as a string; a new file that writes ``"zero3"`` instead of
``Strategy.ZERO3`` fails it and is named.
"""
import ast
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest

from shardwise.config import STRATEGIES, ParallelConfig
from shardwise.config.names import AXES, ZERO_STRATEGIES, Axis, Strategy

REPO = pathlib.Path(__file__).resolve().parents[1]
NAMES = REPO / "shardwise" / "config" / "names.py"


def test_every_strategy_has_a_component_and_every_component_a_name():
    from shardwise.parallel import STRATEGY_CLASSES
    assert set(STRATEGY_CLASSES) == {s.value for s in Strategy} - {Strategy.AUTO.value}
    assert STRATEGIES == tuple(s.value for s in Strategy)
    assert all(type(s) is str for s in STRATEGIES)          # CLI messages print plain words
    assert ZERO_STRATEGIES == ("zero1", "zero2", "zero3")


def test_a_member_is_its_string_everywhere_a_string_goes():
    assert Strategy.ZERO3 == "zero3" and f"{Strategy.THREE_D}" == "3d"
    assert {Axis.TP: 2} == {"tp": 2} and json.dumps({Axis.DP: Strategy.DDP}) == '{"dp": "ddp"}'
    assert ParallelConfig().strategy == Strategy.DDP


def test_the_mesh_and_the_planner_use_the_one_spelling():
    from shardwise import mesh
    from shardwise.planner.layout import KINDS, Layout
    assert mesh.AXES is AXES and [a.value for a in AXES] == ["pp", "dp", "tp"]
    assert [name for name, _ in mesh.Mesh.solo().sizes] == list(AXES)
    assert set(KINDS) == {s.value for s in Strategy} - {"dp", "auto"}
    assert Layout(dp=2, zero=3).kind == Strategy.ZERO3
    assert Layout(tp=2).kind == Strategy.TP and Layout(tp=2, pp=2).kind == Strategy.THREE_D


def test_the_names_module_is_stdlib_only():
    """The planner (pure Python, standalone) imports it, so it must import nothing else."""
    for node in ast.walk(ast.parse(NAMES.read_text())):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top == "__future__", name


@pytest.mark.timeout(120)
def test_strategy_names_are_spelled_in_at_most_three_files_outside_the_components(tmp_path):
    out = tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "architecture_numbers.py"),
                           "--out", str(out)], cwd=REPO, capture_output=True, text=True,
                          timeout=100)
    assert done.returncode == 0, done.stderr
    files = json.loads(out.read_text())["strategy_name_files"]["files"]
    spelled = sorted(files)
    assert len(spelled) <= 3, f"spell these through shardwise.config.names: {spelled}"
    assert any("config/names.py" in p for p in spelled)
