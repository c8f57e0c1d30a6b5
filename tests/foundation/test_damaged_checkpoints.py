"""Damaged checkpoints: a truncated or bit-flipped file, a cut ``meta.json`` or a ``latest``
naming nothing never ends in a traceback. ``--resume`` falls back to the newest intact step
and says which one it passed over, in the one line it prints as it resumes; when none is
intact the run is refused before launch (one line, exit 2); ``checkpoint export`` of a damaged
folder names the intact one. Left-over ``.partial`` folders are cleared by the next save.

One reference run (tiny_config's GPT, one process) saves at steps 4, 8 and 12; each case
damages a copy of its folder. A run resumed from step 8 after step 12 was found damaged must
end bit-identical to the reference (the same arithmetic from the same saved state).
"""
import os
import shutil
from dataclasses import replace

import pytest
import torch

from reference import tiny_config
from shardwise import cli
from shardwise.checkpoint import store
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(240)
STEPS = 12
FLAGS = ["--strategy", "single", "--steps", str(STEPS), "--n-layer", "2", "--n-embd", "32",
         "--n-head", "4", "--block-size", "16", "--vocab-size", "67", "--dataset", "synthetic",
         "--batch-size", "8", "--device", "cpu"]


def _cfg(root, folder, name, resume=False):
    cfg = tiny_config("single", steps=STEPS)
    return replace(cfg, train=replace(cfg.train, checkpoint_dir=folder, checkpoint_every=4,
                                      resume=resume),
                   logging=replace(cfg.logging, out_dir=root, run_name=name))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("damage"))
    summary = train(_cfg(root, f"{root}/ref", "ref"), quiet=True)
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    assert store.steps(f"{root}/ref") == [4, 8, 12]
    return root, summary["losses"], params


def _copy(reference, name):
    root = reference[0]
    folder = f"{root}/{name}"
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(f"{root}/ref", folder)
    return folder


def _rank_file(folder, step):
    step_dir = os.path.join(folder, f"step-{step}")
    return os.path.join(step_dir, next(n for n in os.listdir(step_dir) if n.endswith(".distcp")))


def _truncate(path):
    with open(path, "r+b") as fh:
        fh.truncate(os.path.getsize(path) // 2)


def _flip(path):
    with open(path, "r+b") as fh:
        fh.seek(os.path.getsize(path) // 2)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))


def _cut_meta(folder, step):
    path = os.path.join(folder, f"step-{step}", store.META)
    text = open(path).read()
    open(path, "w").write(text[: len(text) // 3])


@pytest.mark.parametrize("damage, says", [
    (lambda f: _truncate(_rank_file(f, 12)), "bytes, meta.json says"),
    (lambda f: _flip(_rank_file(f, 12)), "does not match its checksum"),
    (lambda f: _cut_meta(f, 12), "meta.json is not a complete checkpoint description"),
])
def test_a_damaged_latest_falls_back_to_the_newest_intact_step(reference, capsys, damage, says):
    root, ref_losses, ref_params = reference
    folder = _copy(reference, "fallback")
    damage(folder)
    summary = train(_cfg(root, folder, "fallback-resumed", resume=True))
    out = [line for line in capsys.readouterr().out.splitlines() if line.startswith("resuming")]
    assert len(out) == 1, out
    assert out[0].startswith("resuming from step 8 (") and "step-12 is damaged (" in out[0], out[0]
    assert says in out[0], out[0]
    assert summary["losses"] == ref_losses[8:]                      # steps 9-12 redone
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    assert all(torch.equal(params[k], ref_params[k]) for k in ref_params)


def test_an_intact_resume_says_where_it_resumes(reference, capsys):
    root = reference[0]
    folder = _copy(reference, "intact")
    shutil.rmtree(os.path.join(folder, "step-12"))
    open(os.path.join(folder, store.LATEST), "w").write("step-8\n")
    summary = train(_cfg(root, folder, "intact-resumed", resume=True))
    summary["engine"].close()
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("resuming")]
    assert line == f"resuming from step 8 ({folder}/step-8, exactly)"


def test_a_latest_naming_nothing_uses_the_newest_step(reference):
    folder = _copy(reference, "pointer")
    open(os.path.join(folder, store.LATEST), "w").write("step-\x00")
    found = store.newest_intact(folder)
    assert found.folder == os.path.join(folder, "step-12") and not found.damaged


def test_every_checkpoint_damaged_is_refused_before_launch_in_one_line(reference, capsys):
    root = reference[0]
    folder = _copy(reference, "all-damaged")
    _truncate(_rank_file(folder, 12))
    _flip(_rank_file(folder, 8))
    _cut_meta(folder, 4)
    code = cli.main(["train", *FLAGS, "--steps", "16", "--checkpoint-dir", folder, "--resume",
                     "--out-dir", root])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "every checkpoint in" in err and "step-12 is damaged" in err and \
        "step-8 is damaged" in err and "step-4 is damaged" in err, err


def test_export_of_a_damaged_checkpoint_names_the_intact_one(reference, capsys, tmp_path):
    folder = _copy(reference, "export")
    _flip(_rank_file(folder, 12))
    code = cli.main(["checkpoint", "export", folder, "--out", str(tmp_path / "m.safetensors")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "is damaged" in err and f"use {folder}/step-8, the newest intact one" in err, err
    assert not os.path.exists(tmp_path / "m.safetensors")


def test_left_over_partial_folders_are_cleared_by_the_next_save(reference):
    root = reference[0]
    folder = _copy(reference, "partials")
    shutil.rmtree(os.path.join(folder, "step-12"))
    open(os.path.join(folder, store.LATEST), "w").write("step-8\n")
    for stale in ("step-5.partial", "step-99.partial"):
        os.makedirs(os.path.join(folder, stale))
        open(os.path.join(folder, stale, "__0_0.distcp"), "w").write("half a save")
    summary = train(_cfg(root, folder, "partials-resumed", resume=True), quiet=True)
    summary["engine"].close()
    assert not [n for n in os.listdir(folder) if n.endswith(".partial")]
    assert store.newest_intact(folder).folder == os.path.join(folder, "step-12")
