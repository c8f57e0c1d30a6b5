"""The README's tour, run as a newcomer would: every command of its code block, in a shell, from
an empty folder (with the repository's examples/ beside it), with fewer steps.

A command passes when it exits 0 and prints no traceback. Training commands get
``--steps 3 --eval-every 0 --eval-batches 1`` appended (later flags win) and write their runs to
a folder of their own in the temporary folder. Two commands run at a time: most of a command's
time is process start-up (torchrun's and each rank's torch import), which leaves
a core idle for a while; two at a time fill it (three at a time were slower in CI: 313 s
against 282 s).
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHORTEN = "--steps 3 --eval-every 0 --eval-batches 1"


def tour_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md")).read()
    section = text[text.index("<!-- section:tour -->"):text.index("<!-- /section:tour -->")]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = []
    for line in block.splitlines():
        command = line.split(" #", 1)[0].strip()
        if command:
            commands.append(command)
    return commands


def shortened(command: str, out_dir: str) -> str:
    if not command.startswith("shardwise train") or "--help" in command:
        return command
    head, redirect = (command.split(" > ", 1) + [""])[:2]
    head = f"{head} {SHORTEN} --out-dir {out_dir}"
    return f"{head} > {redirect}" if redirect else head


def shell_env() -> dict:
    """The environment a newcomer's shell has: this interpreter's scripts first, no RANK."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env.pop("RANK", None)
    return env


def run_shell(run: str, cwd, env: dict, timeout: float) -> str | None:
    """Run one command in bash; None when it exits 0 with no traceback, else what to report."""
    done = subprocess.run(["bash", "-c", run], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    output = done.stdout + done.stderr
    if done.returncode != 0 or "Traceback" in output:
        return f"$ {run}\nexit {done.returncode}\n{output[-3000:]}"
    return None


def test_the_tour_block_is_found():
    commands = tour_commands()
    assert commands[0] == "shardwise train" and len(commands) >= 8
    assert all(c.startswith("shardwise") for c in commands)


@pytest.mark.timeout(1200)
def test_every_tour_command_runs(tmp_path):
    os.symlink(os.path.join(ROOT, "examples"), tmp_path / "examples")
    env = shell_env()

    def run_one(i_command: tuple[int, str]) -> str | None:
        i, command = i_command
        return run_shell(shortened(command, str(tmp_path / "runs" / str(i))), tmp_path, env, 400)
    with ThreadPoolExecutor(max_workers=2) as pool:
        failures = [f for f in pool.map(run_one, enumerate(tour_commands())) if f]
    assert not failures, "\n\n".join(failures)
    log = (tmp_path / "train.log").read_text()
    assert re.search(r"^step 3/3 \| loss ", log, re.M), log   # log lines when not a terminal
