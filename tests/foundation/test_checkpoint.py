"""Checkpoints on one process: a stop saves and the resumed run is bit-identical, a kill during a
save leaves the previous checkpoint loadable, bad settings are refused before launch (one line,
exit 2), and ``shardwise checkpoint inspect | export`` read what was saved.

Every run is tiny_config's GPT on one process (the layouts: tests/parallel/
test_checkpoint_layouts.py). Resumed runs are compared bit for bit: the same process redoes the
same arithmetic from the same saved state, so no tolerance applies.
"""
import json
import multiprocessing as mp
import os
import signal
import time
from dataclasses import replace

import pytest
import torch

from harness import run_world
from reference import tiny_config
from shardwise import cli
from shardwise.checkpoint import store
from shardwise.models import build_model
from shardwise.run.runtime import init_runtime
from shardwise.run.stopping import Stopped
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(240)
STEPS = 12
FLAGS = ["--strategy", "single", "--steps", str(STEPS), "--n-layer", "2", "--n-embd", "32",
         "--n-head", "4", "--block-size", "16", "--vocab-size", "67", "--dataset", "synthetic",
         "--batch-size", "8", "--device", "cpu"]


def _cfg(root, folder, name, every=4, resume=False):
    cfg = tiny_config("single", steps=STEPS)
    return replace(cfg, train=replace(cfg.train, checkpoint_dir=folder, checkpoint_every=every,
                                      resume=resume),
                   logging=replace(cfg.logging, out_dir=root, run_name=name, log_every=1))


def _train(cfg):
    summary = train(cfg, init_runtime(cfg), quiet=True)
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    return summary["losses"], params


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """An uninterrupted run saving every 4 steps (checkpoints at 4, 8, 12; keep 3)."""
    root = str(tmp_path_factory.mktemp("ck"))
    losses, params = _train(_cfg(root, f"{root}/ref", "ref"))
    return root, losses, params


def _stopped_run(rank, world, root, background):
    """SIGTERM to this process as its third step begins; then resume in a fresh engine.
    ``background``: save every step with --checkpoint-async, so the stop lands while the save
    of its own step may still be in the writer thread (the stop must wait for it)."""
    name = "sig-async" if background else "sig"
    cfg = _cfg(root, f"{root}/{name}", name, every=1 if background else 0)
    cfg = replace(cfg, train=replace(cfg.train, checkpoint_async=background))
    # the signal is sent from the training thread itself as step 3 begins (a watcher thread
    # polling metrics.jsonl was starved on a loaded machine until after the last step)
    from shardwise.run.api import Engine
    step_of = Engine.train_step
    calls = [0]

    def train_step(self, *a, **k):
        calls[0] += 1
        if calls[0] == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return step_of(self, *a, **k)
    Engine.train_step = train_step          # a forked child: the parent's class is untouched
    try:
        train(cfg, init_runtime(cfg), quiet=True)
        return None                        # finished before the signal landed
    except Stopped:
        pass
    finally:
        Engine.train_step = step_of         # the resumed run below is not stopped
    stopped_at = json.load(open(os.path.join(root, name, "stopped.json")))["step"]
    saved = store.read_meta(store.latest(f"{root}/{name}"))["step"]
    resumed = replace(cfg, train=replace(cfg.train, resume=True),
                      logging=replace(cfg.logging, run_name=f"{name}-resumed"))
    losses, params = _train(resumed)
    return stopped_at, saved, losses, params


@pytest.mark.parametrize("background", [False, True], ids=["sync", "async"])
def test_a_stop_saves_and_the_resumed_run_is_bit_identical(reference, background):
    root, ref_losses, ref_params = reference
    out = run_world(_stopped_run, 1, root, background, timeout=120)[0]
    assert out is not None, "the run finished before SIGTERM reached it"
    stopped_at, saved, losses, params = out
    assert 2 <= stopped_at < STEPS and saved == stopped_at   # saved at the step it stopped
    assert losses == ref_losses[stopped_at:]
    assert _equal(params, ref_params)


def _save_forever(root):
    cfg = _cfg(root, f"{root}/kill", "kill", every=1)
    train(cfg, init_runtime(cfg), quiet=True)


def test_a_kill_during_a_save_leaves_the_previous_checkpoint(reference):
    root, ref_losses, ref_params = reference
    child = mp.get_context("fork").Process(target=_save_forever, args=(root,))
    child.start()
    folder, deadline = f"{root}/kill", time.monotonic() + 60
    # wait for one published checkpoint and a later save under way, then kill in the middle
    while time.monotonic() < deadline and child.is_alive():
        names = os.listdir(folder) if os.path.isdir(folder) else []
        if store.LATEST in names and any(n.endswith(".partial") for n in names):
            break
        time.sleep(0.001)
    os.kill(child.pid, signal.SIGKILL)
    child.join()
    assert child.exitcode == -signal.SIGKILL, "the child finished before the kill"
    latest = store.latest(folder)
    assert latest is not None
    step = store.read_meta(latest)["step"]
    assert step < STEPS
    losses, params = _train(_cfg(root, folder, "kill-resumed", every=1, resume=True))
    assert losses == ref_losses[step:]
    assert _equal(params, ref_params)
    assert not any(n.endswith(".partial") for n in os.listdir(folder))   # cleared


@pytest.mark.parametrize("extra, says", [
    (["--checkpoint-dir", "{root}/empty", "--resume"], "train.resume = True: there is no "
     "checkpoint in"),
    (["--checkpoint-every", "2"], "train.checkpoint_every = 2: needs a folder"),
    (["--resume"], "train.resume = True: needs a folder"),
    (["--checkpoint-dir", "{root}/a-file/ck"], "train.checkpoint_dir = "),
    (["--checkpoint-dir", "{root}/ref"], "holds a checkpoint already"),
    (["--checkpoint-dir", "{root}/ref", "--resume"], "train.steps = 12: the checkpoint"),
    (["--checkpoint-async"], "train.checkpoint_async = True: needs a folder"),
    (["--checkpoint-dir", "{root}/ref", "--resume", "--steps", "20", "--lora-rank", "4",
      "--lora-targets", "*attn.qkv"], "cannot be resharded into this layout: LoRA adapters"),
    (["--checkpoint-dir", "{root}/ref", "--resume", "--steps", "20", "--n-embd", "64"],
     "model.n_embd = 64: differs from the checkpoint's (32)"),
])
def test_bad_checkpoint_settings_are_refused_before_launch(reference, capsys, extra, says):
    root = reference[0]
    open(os.path.join(root, "a-file"), "w").close()
    code = cli.main(["train", *FLAGS, *[a.format(root=root) for a in extra]])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err


def test_inspect_and_export(reference, capsys, tmp_path):
    from safetensors.torch import load_file
    root, _, ref_params = reference
    assert cli.main(["checkpoint", "inspect", f"{root}/ref", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert (info["step"], info["layout"], info["world_size"]) == (STEPS, "single", 1)
    assert info["parameters"] == sum(t.numel() for t in ref_params.values())
    assert info["kept"] == ["step-4", "step-8", "step-12"] and info["bytes"] > 0
    assert info["config"]["model"]["n_embd"] == 32
    assert cli.main(["checkpoint", "inspect", f"{root}/ref/step-4"]) == 0
    assert "step        4 of 12" in capsys.readouterr().out
    out = str(tmp_path / "model.safetensors")
    assert cli.main(["checkpoint", "export", f"{root}/ref", "--out", out]) == 0
    model = build_model(tiny_config().model, seed=123)        # a fresh model, other weights
    model.load_state_dict(load_file(out))                     # strict: every name, every shape
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), ref_params[name]), name
    assert cli.main(["checkpoint", "inspect", str(tmp_path)]) == 2
    assert "holds no checkpoint" in capsys.readouterr().err


def test_publish_newest_only_keeps_latest_on_the_newer_step(tmp_path):
    """Replica groups (``newest_only``): a save of an older step published after a newer one
    (two writer groups, a background save finishing late) leaves ``latest`` on the newer;
    without it ``latest`` follows the last publish (a run resumed from an older step)."""
    for newest_only, expected in ((True, "step-4"), (False, "step-2")):
        root = str(tmp_path / str(newest_only))
        for step in (4, 2):
            store.begin(root, step)
            store.publish(root, step, {"step": step}, keep=5, newest_only=newest_only)
        assert os.path.basename(store.latest(root)) == expected
        assert store.steps(root) == [2, 4]
