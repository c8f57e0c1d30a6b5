"""Replica groups on a CUDA host (``--ft-replicas``; issue 31's kind of bug, found while working
on issue 34): each group is a torchrun of its own whose local ranks start at 0, so without a
slice of its own every group's rank r took GPU r (two groups of 4 on 8 GPUs: GPUs 0-3 doubled,
4-7 idle). The launcher now gives group g the visible devices g x per to (g + 1) x per - 1
(launch/replicas.group_gpus), and a group restarted at more ranks than its slice holds is
refused before launch (one line, exit 2). The GPU host is simulated: ``gpu_count`` returns a
count, nothing asks CUDA."""
from __future__ import annotations

import pytest

from shardwise import cli
from shardwise.launch import replicas

pytestmark = pytest.mark.timeout(60)


def _cfg(*flags):
    return cli.parse_config(["--nproc-per-node", "8", "--ft-replicas", "2", *flags])[0]


def test_each_group_sees_its_own_gpus(monkeypatch):
    monkeypatch.setattr(replicas, "gpu_count", lambda: 8)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    cfg = _cfg()
    assert replicas.group_gpus(cfg, 0, 4) == {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    assert replicas.group_gpus(cfg, 1, 4) == {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3,5,7")     # the launcher's own view
    monkeypatch.setattr(replicas, "gpu_count", lambda: 4)
    assert replicas.group_gpus(_cfg("--nproc-per-node", "4"), 1, 2) == \
        {"CUDA_VISIBLE_DEVICES": "5,7"}
    assert replicas.group_gpus(_cfg("--device", "cpu"), 1, 4) == {}   # CUDA not asked
    monkeypatch.setattr(replicas, "gpu_count", lambda: 0)
    assert replicas.group_gpus(cfg, 1, 4) == {}


def test_a_restart_beyond_its_gpus_is_refused(monkeypatch, capsys):
    monkeypatch.setattr(replicas, "gpu_count", lambda: 8)
    code = cli.main(["train", "--steps", "2", "--nproc-per-node", "8", "--ft-replicas", "2",
                     "--ft-rejoin-nproc", "6", "--max-restarts", "1", "--batch-size", "120"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert err.startswith("error: parallel.ft_rejoin_nproc = 6: a CUDA run gives each replica "
                          "group its own 4 GPU(s)"), err
