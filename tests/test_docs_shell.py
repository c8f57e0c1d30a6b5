"""Every shell block of the docs (```bash / ```sh / ```console in README.md and docs/*.md) runs,
or says on the line before it why it does not (``<!-- not run: REASON -->``: a GPU, several hosts,
a download, minutes of benchmarking, placeholders for a person's own files).

A block runs as a newcomer would type it: its commands in order, in a shell, in a fresh folder of
its own (the repository's examples/ and README.md beside them, as the docs assume), training
commands shortened as the README tour test does (tests/foundation/test_readme_tour.py:
``--steps 3 --eval-every 0 --eval-batches 1 --out-dir ...``; a ``--resume`` continues to a few
steps more, so that it has steps left). To keep CI within a few minutes, a block's first training
command trains and the others are checked with ``--print-config`` (every check a launch makes;
``SHARDWISE_DOCS_SHELL=full`` trains them all). A command passes when it exits 0 and prints no
traceback.
Commands the README tour test already runs are not run twice. Two blocks run at a time, as in
the tour test (most of a command's time is process start-up).
"""
from __future__ import annotations

import glob
import os
import re
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "foundation"))
from test_readme_tour import SHORTEN, run_shell, shell_env, shortened, tour_commands  # noqa: E402

# SHARDWISE_DOCS_SHELL=full trains every training command (about 8 minutes on 2 busy cores)
FULL = os.environ.get("SHARDWISE_DOCS_SHELL") == "full"
FENCE = re.compile(r"^```(bash|sh|console)\n(.*?)^```", re.M | re.S)
NOT_RUN = re.compile(r"^<!-- not run: (?P<reason>\S.*?) -->$")


def pages() -> list[str]:
    return [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))


def commands_of(lang: str, body: str) -> list[str]:
    """The block's commands: continuation lines joined, comments after `` #`` dropped; in a
    console block only the ``$ `` lines (the rest is output)."""
    lines, joined = body.splitlines(), []
    if lang == "console":
        lines = [ln[2:] for ln in lines if ln.startswith("$ ")]
    current = ""
    for line in lines:
        current += line.strip() if current else line.rstrip()
        if current.endswith("\\"):
            current = current[:-1].rstrip() + " "
            continue
        command = current.split(" #", 1)[0].strip()
        if command and not command.startswith("#"):
            joined.append(command)
        current = ""
    return joined


def blocks() -> list[dict]:
    """Every shell block: page, line, the marker's reason (None: unmarked), commands."""
    found = []
    for path in pages():
        text = open(path).read()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[:m.start()].rstrip("\n").rsplit("\n", 1)[-1] if line > 1 else ""
            marker = NOT_RUN.match(before.strip())
            found.append(dict(where=f"{os.path.relpath(path, ROOT)}:{line}",
                              reason=marker.group("reason") if marker else None,
                              commands=commands_of(m.group(1), m.group(2))))
    return found


def to_run() -> list[dict]:
    """The unmarked blocks, less the commands the README tour test runs."""
    toured = set(tour_commands())
    out = []
    for b in blocks():
        if b["reason"] is None:
            commands = [c for c in b["commands"] if c not in toured]
            if commands:
                out.append(dict(b, commands=commands))
    return out


def shortened_block(commands: list[str], out_dir: str, full: bool = FULL) -> list[str]:
    """The tour's shortening, and a ``--resume`` given steps beyond the checkpoint it resumes.
    Unless ``full``, a block's training commands after its first are checked, not trained:
    ``--print-config`` runs every check a launch runs, then exits (a block that checkpoints
    trains every command: each needs the one before)."""
    out, resumes, trained = [], 0, False
    chained = any("--checkpoint-dir" in c for c in commands)
    for command in commands:
        run = shortened(command, out_dir)
        if run != command and trained and not (full or chained):
            run = command.split(" > ", 1)[0] + " --print-config"
        elif run != command:
            trained = True
            if " --resume" in command:
                resumes += 1
                run = run.replace(SHORTEN, SHORTEN.replace("--steps 3", f"--steps {3 + 2 * resumes}"))
        out.append(run)
    return out


def test_the_blocks_are_found_and_each_is_run_or_marked():
    found = blocks()
    assert len(found) >= 15, [b["where"] for b in found]
    tour = [b for b in found if b["where"].startswith("README.md") and
            b["commands"][:1] == ["shardwise train"]]
    assert tour, "the README tour block was not found"
    for b in found:     # an unmarked block is run (here or by the tour test): it needs commands
        assert b["commands"] or b["reason"], f"{b['where']}: a shell block with no command"
    assert {c for b in to_run() for c in b["commands"]} & set(tour_commands()) == set()
    # a marker stands on the line right before its block, with a reason
    for path in pages():
        lines = open(path).read().splitlines()
        for i, line in enumerate(lines):
            if line.startswith("<!-- not run"):
                assert NOT_RUN.match(line), f"{path}:{i + 1}: write <!-- not run: REASON -->"
                assert i + 1 < len(lines) and re.match(r"```(bash|sh|console)$", lines[i + 1]), \
                    f"{path}:{i + 1}: the marker must stand on the line before a shell block"


def test_commands_are_read_as_a_shell_reads_them():
    body = "a --x 1 \\\n    --y 2   # note\n# only a comment\nb 'p*,q'\n"
    assert commands_of("bash", body) == ["a --x 1 --y 2", "b 'p*,q'"]
    assert commands_of("console", "$ shardwise --version\nshardwise 0.1\n") == ["shardwise --version"]
    assert shortened_block(["shardwise train --strategy zero1", "shardwise plan --model 7B",
                            "shardwise train --strategy zero3 > log"], "o", full=False) == [
        f"shardwise train --strategy zero1 {SHORTEN} --out-dir o", "shardwise plan --model 7B",
        "shardwise train --strategy zero3 --print-config"]
    assert shortened_block(["shardwise train --checkpoint-dir ck",
                            "shardwise train --checkpoint-dir ck --resume"], "o", full=False) == [
        f"shardwise train --checkpoint-dir ck {SHORTEN} --out-dir o",
        f"shardwise train --checkpoint-dir ck --resume {SHORTEN.replace('--steps 3', '--steps 5')}"
        " --out-dir o"]


@pytest.mark.timeout(900)
def test_every_unmarked_block_runs(tmp_path):
    env = shell_env()

    def run_block(i_block: tuple[int, dict]) -> str | None:
        i, block = i_block
        cwd = tmp_path / str(i)
        cwd.mkdir()
        os.symlink(os.path.join(ROOT, "examples"), cwd / "examples")
        os.symlink(os.path.join(ROOT, "README.md"), cwd / "README.md")
        for run in shortened_block(block["commands"], str(cwd / "runs")):
            failure = run_shell(run, cwd, env, 300)
            if failure:
                return f"{block['where']}\n{failure}"
        return None
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(run_block, enumerate(to_run())) if f]
    assert not failures, "\n\n".join(failures)
