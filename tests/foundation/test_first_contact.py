"""What a newcomer meets before any training: the command list, the version, the benchmarks from
the package alone, warnings for slow settings, and the files the README and docs point to."""
from __future__ import annotations

import os
import re
import subprocess
import sys

from shardwise.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_bare_shardwise_lists_the_commands_instead_of_training(capsys):
    assert main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: shardwise COMMAND") and "train" in out and "plan" in out


def test_version(capsys):
    from importlib.metadata import version
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"shardwise {version('shardwise')}"


def test_bench_runs_from_the_package_alone(tmp_path):
    """A copy of the package and nothing else of the checkout (what a wheel installs), run from
    another folder: ``shardwise bench --list`` lists the rows."""
    import shutil
    shutil.copytree(os.path.join(ROOT, "shardwise"), tmp_path / "pkg" / "shardwise")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "pkg")}
    done = subprocess.run([sys.executable, "-m", "shardwise.cli", "bench", "--list"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "ddp-vs-torch-ddp" in done.stdout


def test_fp16_on_cpu_warns_that_it_is_emulated(tmp_path, capsys):
    code = main(["train", "--strategy", "single", "--mixed-precision", "fp16", "--device", "cpu",
                 "--steps", "1", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                 "--block-size", "16", "--batch-size", "2", "--eval-batches", "1",
                 "--dataset", "synthetic", "--no-progress", "--out-dir", str(tmp_path)])
    assert code == 0
    assert "emulated and slow" in capsys.readouterr().err


def test_every_file_the_readme_and_docs_cite_exists():
    docs = [os.path.join(ROOT, "README.md"), os.path.join(ROOT, "shardwise", "bench", "README.md")]
    docs += [os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs"))
             if f.endswith(".md")]
    cited = set()
    for doc in docs:
        text = open(doc).read()
        cited.update(re.findall(r"\b((?:docs|examples|tests|shardwise)/[\w./-]+"
                                r"\.(?:md|py|toml|json|png|yaml))", text))
    assert len(cited) > 10                     # the scan finds the citations it should check
    missing = sorted(c for c in cited if not os.path.exists(os.path.join(ROOT, c)))
    assert not missing, f"cited but absent: {missing}"
