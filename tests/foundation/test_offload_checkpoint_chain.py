"""A checkpoint of a ZeRO run with disk offload is written a piece at a time (checkpoint/pieces.py):
no rank gathers the model or the optimizer state, so a run whose state is larger than RAM can
save. Before, every rank gathered the whole model and both Adam moments and pickled its own
shards into memory for the save (about 56 bytes a parameter per rank at 114M parameters, 8x the
run's own peak), and the checkpoint held every value twice (29.5 bytes a parameter).

At world 2, on tiny_config's GPT: ZeRO-3 with parameters, gradients, masters and Adam states on
disk, and ZeRO-2 with bf16 working copies and fp32 masters on disk (masters apart from the
shards, and whole parameters gathered again after a load), each

  * resumes exactly: run B from run A's step-2 checkpoint gives A's last losses and final
    parameters bit for bit (the same ranks redo the same arithmetic from the same state);
  * writes the layout-free keys as each rank's boxes (some key has chunks from both ranks), and
    a per-rank state without shards (the values are stored once: fp32 masters and two Adam
    moments, 12 bytes a parameter, where they were 29.5);
  * exports (``shardwise checkpoint export``, one process) exactly the run's final.safetensors;
  * reshards: single, in this process, continues from it as single-process training does
    (tests/reference.py's tolerance: the layouts sum gradients in another order).
"""
import os
import shutil
from dataclasses import replace

import pytest
import torch
from safetensors.torch import load_file

from harness import assert_close_runs, run_world
from reference import ATOL, RTOL, tiny_config
from shardwise.checkpoint import dcp_io, store, tools
from shardwise.run.runtime import init_runtime
from shardwise.run.train import FINAL_WEIGHTS, train

pytestmark = pytest.mark.timeout(180)
LAYOUTS = {   # name -> (strategy, memory)
    "zero3-params-disk": ("zero3", {"offload": "disk", "offload_params": True}),
    "zero2-disk-bf16": ("zero2", {"offload": "disk", "mixed_precision": "bf16"}),
}


def _cfg(root, strategy, name, memory=None, resume=False, steps=4):
    cfg = tiny_config(strategy, steps=steps)
    return replace(cfg, memory=replace(cfg.memory, offload_dir=f"{root}/offload",
                                       **(memory or {})),
                   train=replace(cfg.train, checkpoint_dir=f"{root}/{name}", resume=resume,
                                 checkpoint_every=2),
                   logging=replace(cfg.logging, out_dir=root, run_name=name))


def _train(cfg):
    summary = train(cfg, init_runtime(cfg), quiet=True)
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    return summary["losses"], params


def _world(rank, world, root):
    import torch.distributed as dist
    out = {}
    for name, (strategy, memory) in LAYOUTS.items():
        la, pa = _train(_cfg(root, strategy, f"{name}-a", memory))
        if rank == 0:                              # B starts from A's step 2, as if A stopped
            os.makedirs(f"{root}/{name}-b")
            shutil.copytree(f"{root}/{name}-a/step-2", f"{root}/{name}-b/step-2")
            store._write_atomic(f"{root}/{name}-b/{store.LATEST}", "step-2\n")
        dist.barrier()
        lb, pb = _train(_cfg(root, strategy, f"{name}-b", memory, resume=True))
        out[name] = (la, pa, lb, pb)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload-ck"))
    return root, run_world(_world, 2, root, timeout=150)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_offloaded_run_resumes_exactly_from_its_pieces(runs, name):
    _, out = runs
    la, pa, lb, pb = out[name]
    assert lb == la[2:], f"{name}: resumed losses {lb} vs uninterrupted {la[2:]}"
    for key in pa:
        assert torch.equal(pa[key], pb[key]), f"{name}: {key} differs after the resume"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_checkpoint_is_each_ranks_boxes_of_the_layout_free_keys(runs, name, tmp_path):
    root, _ = runs
    folder = store.latest(f"{root}/{name}-a")
    meta = store.read_meta(folder)
    assert meta["reshardable"] and meta["step"] == 4
    from torch.distributed.checkpoint import FileSystemReader
    md = FileSystemReader(folder).read_metadata()
    split = [k for k, v in md.state_dict_metadata.items()
             if k.startswith("model/") and len(v.chunks) > 1]
    assert split, "no layout-free tensor was written in pieces"
    params = meta["parameters"]
    assert params == sum(torch.Size(v[0]).numel() for k, v in dcp_io.stored(folder).items()
                         if v is not None and k.startswith("model/"))
    # each rank's own state holds no shard (the old one: masters and moments, 6 B a parameter
    # per rank at world 2); what it keeps is the RNG states, scalars and parameter groups
    for r in range(2):
        own = sum(info.length for index, info in md.storage_data.items()
                  if index.fqn == f"rank{r}/state")
        assert 0 < own < 2 * params, (r, own, params)
    out = str(tmp_path / "model.safetensors")
    tools.export(folder, out)
    final = load_file(f"{root}/{name}-a/{FINAL_WEIGHTS}")
    exported = load_file(out)
    assert exported.keys() == final.keys()
    for key in final:
        assert torch.equal(exported[key], final[key].to(exported[key].dtype)), key


def test_single_continues_from_an_offloaded_checkpoint(runs):
    root, _ = runs
    ref_losses, ref_params = _train(_cfg(root, "single", "ref"))
    shutil.copytree(f"{root}/zero3-params-disk-a/step-2", f"{root}/from-z3/step-2")
    store._write_atomic(f"{root}/from-z3/{store.LATEST}", "step-2\n")
    losses, params = _train(_cfg(root, "single", "from-z3", resume=True))
    assert_close_runs(losses, ref_losses[2:], params, ref_params, RTOL, ATOL,
                      "zero3 (disk offload) -> single: the layouts sum gradients in another order")


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5), min_size=0, max_size=4), st.data())
def test_boxes_cover_a_flat_range_exactly_once(shape, data):
    """pieces.boxes: the flat elements [lo, hi) of a row-major tensor as rectangular boxes,
    each starting where its flat start says, together covering the range once and nothing
    else (any shape, any range)."""
    import math

    import torch

    from shardwise.checkpoint.pieces import boxes
    n = math.prod(shape)
    lo = data.draw(st.integers(0, n))
    hi = data.draw(st.integers(lo, n))
    hit = torch.zeros(n, dtype=torch.long)
    flat = torch.arange(n).reshape(shape) if shape else torch.arange(1).reshape(())
    for offsets, sizes, start in boxes(shape, lo, hi):
        index = tuple(slice(o, o + s) for o, s in zip(offsets, sizes))
        got = flat[index].reshape(-1)
        assert got.numel() and int(got[0]) == start
        assert torch.equal(got, torch.arange(start, start + got.numel()))
        hit[got] += 1
    assert torch.equal(hit[lo:hi], torch.ones(hi - lo, dtype=torch.long))
    assert int(hit.sum()) == hi - lo
