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
    (tests/reference.py's tolerance: the layouts sum gradients in another order);
  * moves (``--checkpoint-move-last``, run C): the last checkpoint written while each offload
    file's disk blocks are freed holds exactly what A's copied one holds, final.safetensors is
    A's, and the engine refuses to go on from the freed state (one line naming the checkpoint).
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


def _cfg(root, strategy, name, memory=None, resume=False, steps=4, move=False):
    cfg = tiny_config(strategy, steps=steps)
    return replace(cfg, memory=replace(cfg.memory, offload_dir=f"{root}/offload",
                                       **(memory or {})),
                   train=replace(cfg.train, checkpoint_dir=f"{root}/{name}", resume=resume,
                                 checkpoint_every=2, checkpoint_move_last=move),
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
        summary = train(_cfg(root, strategy, f"{name}-c", memory, move=True),
                        init_runtime(_cfg(root, strategy, f"{name}-c", memory)), quiet=True)
        try:
            summary["engine"].full_state_dict()
            refused = ""
        except RuntimeError as exc:
            refused = str(exc)
        summary["engine"].close()
        out[name] = (la, pa, lb, pb, summary["losses"], refused)
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("offload-ck"))
    return root, run_world(_world, 2, root, timeout=150)[0]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_an_offloaded_run_resumes_exactly_from_its_pieces(runs, name):
    _, out = runs
    la, pa, lb, pb = out[name][:4]
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


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_last_checkpoint_moved_from_the_offload_files_equals_a_copied_one(runs, name):
    root, out = runs
    la, lc, refused = out[name][0], out[name][4], out[name][5]
    assert lc == la
    copied, moved = store.latest(f"{root}/{name}-a"), store.latest(f"{root}/{name}-c")
    assert store.read_meta(moved)["step"] == 4
    for prefix in ("model/", "optim/"):
        a, c = dcp_io.read_tensors(copied, prefix), dcp_io.read_tensors(moved, prefix)
        assert a.keys() == c.keys() and a, prefix
        for key in a:
            assert torch.equal(a[key], c[key]), f"{name}: {key} differs in the moved checkpoint"
    final_a = load_file(f"{root}/{name}-a/{FINAL_WEIGHTS}")
    final_c = load_file(f"{root}/{name}-c/{FINAL_WEIGHTS}")   # written before the move
    for key in final_a:
        assert torch.equal(final_a[key], final_c[key]), key
    assert "moved into the checkpoint" in refused and "step-4" in refused, refused


def test_discard_frees_the_file_where_release_keeps_it(tmp_path):
    """OffloadStore.discard punches the file (reads zeros: the bytes are gone from the disk);
    release only drops the pages (reads the data back)."""
    from shardwise.memory.offload import OffloadStore
    s = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    kept, freed = s.zeros(1 << 16), s.zeros(1 << 16)
    kept.fill_(3.0)
    freed.fill_(3.0)
    s.release([kept, freed])
    s.drain()
    s.discard([freed])
    assert torch.all(kept == 3.0) and torch.all(freed == 0.0)
    s.close()


def test_a_move_discards_each_owner_once_after_its_last_box(tmp_path):
    """dcp_io.save with ``discard``: every store tensor is discarded exactly once, and only
    after the writer wrote all boxes in it, also when owners are views of one store tensor (as
    Adam's states of a chunk's parameter groups are): each box's values are in the checkpoint,
    none zeroed early."""
    from shardwise.checkpoint.pieces import _split
    from shardwise.comm.collectives import Group
    base = torch.arange(0.0, 120.0)
    owners = [base[:60], base[60:], torch.arange(200.0, 260.0)]   # 0 and 1 share a storage
    pieces = []
    for k, o in enumerate(owners):      # each owner: boxes of two tensors of different sizes
        pieces += _split(f"model/w{k}", (6, 5), 0, 30, o[:30], o)
        pieces += _split(f"model/v{k}", (30,), 0, 30, o[30:], o)
    expect = [o.clone() for o in owners]
    freed = []

    def discard(ts):                    # what freeing the blocks does: the whole store tensor
        for t in ts:
            ptr = t.untyped_storage().data_ptr()
            freed.append(ptr)
            for o in owners:
                if o.untyped_storage().data_ptr() == ptr:
                    o.zero_()
    dcp_io.save({}, str(tmp_path / "ck"), Group.solo(), pieces, None, discard)
    assert sorted(freed) == sorted({o.untyped_storage().data_ptr() for o in owners})
    back = dcp_io.read_tensors(str(tmp_path / "ck"), "model/")
    for k in range(3):
        assert torch.equal(back[f"w{k}"].reshape(-1), expect[k][:30]), k
        assert torch.equal(back[f"v{k}"], expect[k][30:]), k


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
