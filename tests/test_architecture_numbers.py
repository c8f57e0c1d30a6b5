"""scripts/architecture_numbers.py: every number it prints is computed, and computed right.

On the repository: the JSON is well formed (provenance, each count equal to the list behind it).
On a tiny fake package built here: each count equals what the fake was built to contain.
"""
import importlib.util
import json
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.timeout(120)

REPO = pathlib.Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "architecture_numbers.py"


def load_script():
    spec = importlib.util.spec_from_file_location("architecture_numbers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module       # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_on_the_repository_the_json_is_well_formed(tmp_path):
    out = tmp_path / "numbers.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--out", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=100)
    assert done.returncode == 0, done.stderr
    n = json.loads(out.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", n["commit"]) and isinstance(n["dirty"], bool)
    assert n["commit_date"] and n["measured_at"]
    assert set(n["stages"]) == {"1", "2", "3"}
    for s in n["stages"].values():
        assert s["num_classes"] == len(s["classes"]) >= 1
        assert s["num_files"] == len(s["files"]) >= 1
        assert s["class"].rsplit(".", 1)[1] == s["classes"][0].rsplit(".", 1)[1]
    tower = n["zero2_tower"]
    assert tower["classes"] == n["stages"]["2"]["num_classes"]
    assert tower["names_defined_more_than_once"] == len(tower["repeated_names"])
    assert tower["methods"] >= tower["names_defined_more_than_once"]
    for key, rows in (("strategy_name_files", "files"), ("long_functions", "functions"),
                      ("big_constructors", "constructors"), ("new_axis_files", "files"),
                      ("unlayered", "modules")):
        assert n[key]["count"] == len(n[key][rows]), key
    assert all(r["lines"] > 50 for r in n["long_functions"]["functions"])
    assert all(r["arguments"] > 6 for r in n["big_constructors"]["constructors"])
    entries = n["root_entries"]
    on_disk = [p for p in (REPO / "shardwise").iterdir() if p.name != "__init__.py" and (
        p.suffix == ".py" or (p / "__init__.py").exists())]
    assert entries["count"] == len(on_disk) == len(entries["modules"]) + len(entries["packages"])
    assert n["seed_references"]["count"] == sum(n["seed_references"]["files"].values())
    assert sum(n["seed_references"]["by_area"].values()) == n["seed_references"]["count"]
    assert done.stdout.count("\n") >= 10


# --- the fake package: what it contains is declared here, the expected counts derive from it --
TOWER = {   # class -> (module, bases, methods); Z2 -> Z1 -> (Mixin, Base) -> Shared (a diamond)
    "Shared": ("base", [], ["close", "step"]),
    "Base": ("base", ["Shared"], ["step", "wrap", "state_dict"]),
    "Mixin": ("mixin", ["Shared"], ["step", "_hook"]),
    "Z1": ("z", ["Mixin", "Base"], ["step", "wrap"]),
    "Z2": ("z", ["Z1"], ["step", "backward"]),
}
LONG = {"long_a": 51, "long_b": 80, "just_fifty": 50, "short": 3}      # name -> lines
NESTED = 60     # a method holding a nested function of this many lines spans one more
CTORS = {   # class -> __init__ parameters (self excluded)
    "Six": "a, b, c, d, e, f", "Seven": "a, b, c, d, e, f, g",
    "Star": "a, *args, b, c, d, e, **kw", "KwOnly": "a, /, b, *, c, d, e, f, g",
}
SEED_LINES = ["see seed " "001 here", "Seed " "000 and seeds " "002",   # split: no hit in this file
              "seed 1 and seed " "0001 do not count"]


def function_source(name: str, lines: int) -> str:
    body = [f"    x{i} = {i}" for i in range(lines - 2)]
    return "\n".join([f"def {name}():"] + body + ["    return 0"]) + "\n"


def write(root: pathlib.Path, rel: str, text: str) -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))


def build_fake(root: pathlib.Path) -> None:
    write(root, "fake/__init__.py", "")
    write(root, "fake/parallel/__init__.py", '''
        STRATEGY_CLASSES = {"zero1": "fake.parallel.z:Z1", "zero2": "fake.parallel.z:Z2",
                            "ddp": "fake.parallel.base:Base"}
        KIND = "zero2"   # inside parallel/: the strategies' own component, not counted
        ''')
    for module in {m for m, _, _ in TOWER.values()}:
        classes = {c: v for c, v in TOWER.items() if v[0] == module}
        imports = "".join(f"from .{TOWER[b][0]} import {b}\n" for c in classes
                          for b in TOWER[c][1] if TOWER[b][0] != module)
        body = "".join(f"class {c}({', '.join(bases)}):\n" + "".join(
            f"    def {m}(self):\n        pass\n" for m in methods) for c, (_, bases, methods)
            in classes.items())
        write(root, f"fake/parallel/{module}.py", imports + body)
    write(root, "fake/long.py", "".join(function_source(n, k) for n, k in LONG.items())
          + "class Holder:\n    def method(self):\n"
          + textwrap.indent(function_source("nested", NESTED), "        "))
    write(root, "fake/ctor.py", "".join(f"class {c}:\n    def __init__(self, {p}):\n"
                                        f"        pass\n" for c, p in CTORS.items()))
    write(root, "fake/names.py", '''
        """Docstring naming ddp and zero1 does not count."""
        MODE = "zero1"
        LABEL = f"{MODE} ddp"
        def pick(cfg):
            return cfg.parallel.tp
        ''')
    write(root, "fake/axis.py", 'SIZES = {"dp": 2}\ndef f(dp_size):\n    return dp_size\n'
          'def g():\n    """zero2"""\n')     # a docstring equal to a name: not counted
    write(root, "fake/mesh.py", 'AXES = ("pp", "dp", "tp")\n')
    write(root, "fake/tools/__init__.py", "")
    (root / "fake" / "assets").mkdir()
    write(root, "README.md", "\n".join(SEED_LINES) + "\n")
    write(root, "pyproject.toml", '''
        [tool.importlinter]
        root_package = "fake"
        [[tool.importlinter.contracts]]
        name = "layers"
        type = "layers"
        containers = ["fake"]
        layers = ["tools", "long | (ctor)", "parallel"]
        [[tool.importlinter.contracts]]
        name = "names"
        type = "forbidden"
        source_modules = ["fake.names"]
        forbidden_modules = ["fake.parallel"]
        ''')


def mro(name: str) -> list[str]:
    """Python's own MRO of the declared tower (classes built with type())."""
    made = {}
    for c, (_, bases, _) in TOWER.items():
        made[c] = type(c, tuple(made[b] for b in bases) or (object,), {})
    return [k.__name__ for k in made[name].__mro__ if k is not object]


def test_on_a_fake_package_each_count_is_exact(tmp_path):
    build_fake(tmp_path)
    n = load_script().measure(str(tmp_path), "fake")
    for stage, cls in (("1", "Z1"), ("2", "Z2")):
        got = n["stages"][stage]
        assert [c.rsplit(".", 1)[1] for c in got["classes"]] == mro(cls)
        assert got["num_files"] == len({TOWER[c][0] for c in mro(cls)})
    methods = [m for c in mro("Z2") for m in TOWER[c][2]]
    repeated = sorted({m for m in methods if sum(m in TOWER[c][2] for c in mro("Z2")) > 1})
    assert n["zero2_tower"]["methods"] == len(methods)
    assert n["zero2_tower"]["repeated_names"] == repeated
    assert n["strategy_name_files"]["files"] == {"fake/names.py": ["zero1"]}
    long_ones = {k: v for k, v in LONG.items() if v > 50} | {"method": NESTED + 1,
                                                             "nested": NESTED}
    assert {r["name"]: r["lines"] for r in n["long_functions"]["functions"]} == long_ones
    arity = {c: len(p.replace("/,", "").replace("*,", "").split(",")) for c, p in CTORS.items()}
    assert {r["class"]: r["arguments"] for r in n["big_constructors"]["constructors"]} == \
        {c: k for c, k in arity.items() if k > 6}
    assert n["root_entries"]["modules"] == ["axis", "ctor", "long", "mesh", "names"]
    assert n["root_entries"]["packages"] == ["parallel", "tools"]
    assert n["root_entries"]["not_counted"] == ["assets"]
    assert n["unlayered"]["modules"] == ["fake.axis", "fake.mesh", "fake.names"]
    assert n["unlayered"]["in_no_contract"] == ["fake.axis", "fake.mesh"]
    seeds = sum(len(re.findall(r"\bseeds? 0\d\d\b", line, re.I)) for line in SEED_LINES)
    assert n["seed_references"]["count"] == seeds
    assert n["new_axis_files"]["files"] == {"fake/axis.py": ["a", "c"], "fake/mesh.py": ["a"],
                                               "fake/names.py": ["b"]}
    assert n["commit"] is None and n["dirty"] is None    # not a git checkout


def test_refuses_a_missing_package_with_exit_2(tmp_path, capsys):
    assert load_script().main(["--root", str(tmp_path), "--package", "nothing"]) == 2
    assert "--root" in capsys.readouterr().err
