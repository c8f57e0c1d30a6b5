"""bench/run.py's commit(): the HEAD a result JSON records, read from .git's files, in a plain
checkout and in a ``git worktree`` (where .git is a file naming the real git dir)."""
import subprocess

import pytest

from shardwise.bench.run import commit


def _git(*args, cwd):
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True,
                          text=True).stdout.strip()


def test_commit_in_a_checkout_and_in_a_worktree(tmp_path, monkeypatch):
    monkeypatch.delenv("SHARDWISE_COMMIT", raising=False)
    main = tmp_path / "main"
    main.mkdir()
    try:
        _git("init", "-q", "-b", "trunk", cwd=main)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git binary here")
    (main / "f.txt").write_text("a")
    for args in (("add", "f.txt"), ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm",
                                    "one")):
        _git(*args, cwd=main)
    _git("worktree", "add", "-q", "-b", "side", str(tmp_path / "wt"), cwd=main)
    (tmp_path / "wt" / "g.txt").write_text("b")
    _git("add", "g.txt", cwd=tmp_path / "wt")
    _git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "two", cwd=tmp_path / "wt")
    (tmp_path / "wt" / "pkg").mkdir()
    assert commit(str(main)) == _git("rev-parse", "--short=7", "HEAD", cwd=main)
    side = _git("rev-parse", "--short=7", "HEAD", cwd=tmp_path / "wt")
    assert commit(str(tmp_path / "wt" / "pkg")) == side      # a folder inside the worktree
    _git("pack-refs", "--all", cwd=main)                     # branches only in packed-refs
    assert commit(str(tmp_path / "wt")) == side
