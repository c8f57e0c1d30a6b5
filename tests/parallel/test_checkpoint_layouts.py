"""Checkpoints under every layout: an interrupted-and-resumed run is bit-identical to one that
never stopped, and a checkpoint saved in one layout continues in another (reshard).

Exact resume (same layout, same world): a layout trains 4 steps saving every 2 (run A); run B
resumes from A's step-2 checkpoint (copied into a fresh folder, as if A had stopped there) in a
fresh engine built from fresh weights, and must give A's last 2 losses and A's final parameters
bit for bit (dropout 0.1 in these pairs: the RNG states are restored too). single, zero3 and
ddp take their run A from the reshard chain below. The layouts here cover each state
shape: DDP's replicas, ZeRO's flat shards (stage 3; stage 2 with bf16 working copies and fp32
masters offloaded to the CPU; stage 3 with parameters, gradients and states offloaded to disk), tensor-parallel slices, a pipeline with its flat ZeRO-1, and the
parameter server (ZeRO-1 and pp2 over DDP were checked the same way when this was written). No tolerance: the same
ranks redo the same arithmetic on the same state.

ddp with --checkpoint-async (background saves every step) is an exact pair too, and its run A
must leave every save published, complete and in order.

Reshard (another layout or world): single (this process) saves at steps 2, 4, 6. The world of 4
runs zero3 (dp 4) from single's step 2 (saves 4), tp2 x pp2 (ZeRO-1) from zero3-w4's step 4,
and zero3 x tp2 and pp2 x dp2 (ZeRO-1, and DDP) from single's step 4 (saving every step). The world of 2 runs
zero3 from single's step 2 (saves 4), ddp from zero3-w4's step 4 (saves 5), tp2, tp2 with
sequence parallelism and cp 2 (context parallel, ring) from single's step 4, and ps from single's
step 2 (saves 4). This process then continues single from ddp's, tp2's, tp2 + sp's, cp 2's,
tp2 x pp2's and pp2 x dp2's step 5 and from ps's step 4. In this process
too, dp (2 replicas) from single's step 2 (saves 4), and single from dp's step 4. Every segment
must equal single-process training continued from the same point, losses and final parameters, at fp32
rtol/atol 1e-5 (tests/reference.py: the layouts sum gradients in another order).

One forked world of 4 and one of 2 run every multi-process run (ps at world 2: one ps task,
one worker).
"""
import os
import shutil
from dataclasses import replace

import pytest
import torch

from harness import assert_close_runs, run_world
from reference import ATOL, RTOL, tiny_config
from shardwise.checkpoint import store
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(480)
STEPS = 6


def _cfg(strategy, folder, every=2, resume=False, steps=STEPS, dropout=0.0, memory=None,
         train=None, **parallel):
    cfg = tiny_config(strategy, steps=steps, **parallel)
    return replace(cfg, model=replace(cfg.model, dropout=dropout),
                   memory=replace(cfg.memory, **(memory or {})),
                   train=replace(cfg.train, **{"checkpoint_dir": folder, "resume": resume,
                                               "checkpoint_every": every, **(train or {})}),
                   logging=replace(cfg.logging, schedule_png="off"))


def _train(cfg):
    summary = train(cfg, init_runtime(cfg), quiet=True)
    params = summary["engine"].full_state_dict()
    summary["engine"].close()
    return summary["losses"], params


def _seed(src: str, dst: str, rank: int = 0) -> None:
    """A fresh --checkpoint-dir holding only ``src`` (a step-N folder), as latest."""
    if rank == 0:
        name = os.path.basename(src)
        os.makedirs(dst)
        shutil.copytree(src, os.path.join(dst, name))
        store._write_atomic(os.path.join(dst, store.LATEST), name + "\n")


EXACT = {   # name -> (strategy, parallel, memory, train): a pair of runs of their own
    "zero2-offload-bf16": ("zero2", {}, {"offload": "cpu", "mixed_precision": "bf16"}, {}),
    # ZeRO-Infinity: parameter shards, gradients, masters and Adam states in files
    "zero3-offload-params-disk": ("zero3", {}, {"offload": "disk", "offload_params": True}, {}),
    "tp2": ("tp", {"tp": 2}, {}, {}),
    "pp2-zero1": ("3d", {"pp": 2, "zero_stage": 1}, {}, {}),
    "ps": ("ps", {}, {}, {}),
    # background saves at steps 1, 2, 3 (each waits for the one before), the last at once
    "ddp-async": ("ddp", {}, {}, {"checkpoint_async": True, "checkpoint_every": 1}),
}


def _exact_pair(root, name, rank, barrier):
    strategy, parallel, memory, train = EXACT[name]
    a, b = f"{root}/{name}-a", f"{root}/{name}-b"
    la, pa = _train(_cfg(strategy, a, steps=4, dropout=0.1, memory=memory, train=train,
                         **parallel))
    kept = [2, 3, 4] if train.get("checkpoint_every") == 1 else [2, 4]   # the newest 3 (--keep)
    if rank == 0:    # every save published, complete, in order
        assert store.latest(a) == f"{a}/step-4" and store.steps(a) == kept, store.steps(a)
    _seed(f"{a}/step-2", b, rank)
    barrier()
    lb, pb = _train(_cfg(strategy, b, steps=4, resume=True, dropout=0.1, memory=memory,
                         train=train, **parallel))
    return la[2:], pa, lb, pb


def _resume(strategy, src, dst, rank, barrier, every=2, **parallel):
    """Resume ``strategy`` from the step-N folder ``src``, copied into a fresh folder ``dst``."""
    _seed(src, dst, rank)
    barrier()
    return _train(_cfg(strategy, dst, every=every, resume=True, **parallel))


def _world(rank, world, root):
    import torch.distributed as dist
    barrier = dist.barrier
    out = {name: _exact_pair(root, name, rank, barrier) for name in EXACT}
    # the reshard chain; each resharded run is also the uninterrupted run of an exact pair
    z = out["zero3<-single"] = _resume("zero3", f"{root}/S/step-2", f"{root}/Z", rank, barrier)
    out["zero3"] = (z[0][2:], z[1], *_resume("zero3", f"{root}/Z/step-4", f"{root}/Z2", rank,
                                             barrier))
    d = out["ddp<-zero3w4"] = _resume("ddp", f"{root}/Z4/step-4", f"{root}/D", rank, barrier, 1)
    out["ddp"] = (d[0][1:], d[1], *_resume("ddp", f"{root}/D/step-5", f"{root}/D2", rank,
                                           barrier))
    out["tp2<-single"] = _resume("tp", f"{root}/S/step-4", f"{root}/T", rank, barrier, 1, tp=2)
    out["tp2sp<-single"] = _resume("tp", f"{root}/S/step-4", f"{root}/TS", rank, barrier, 1,
                                   tp=2, sequence_parallel=True)
    out["ps<-single"] = _resume("ps", f"{root}/S/step-2", f"{root}/PS", rank, barrier)
    out["cp2<-single"] = _resume("ddp", f"{root}/S/step-4", f"{root}/CP", rank, barrier, 1,
                                 cp=2)
    return out


def _world4(rank, world, root):
    """The world-4 saves and loads: zero3 (dp 4); tp2 x pp2 (ZeRO-1 over dp 1: its tp pieces);
    zero3 x tp2; pp2 x dp2, with ZeRO-1 (its flat dp shards) and with the DDP stage."""
    import torch.distributed as dist
    barrier = dist.barrier
    return {"zero3w4<-single": _resume("zero3", f"{root}/S/step-2", f"{root}/Z4", rank, barrier),
            "tp2pp2<-zero3w4": _resume("3d", f"{root}/Z4/step-4", f"{root}/P", rank, barrier, 1,
                                       tp=2, pp=2, zero_stage=1),
            "pp2dp2ddp<-single": _resume("3d", f"{root}/S/step-4", f"{root}/PD", rank, barrier,
                                         1, pp=2),
            "zero3tp2<-single": _resume("3d", f"{root}/S/step-4", f"{root}/ZT", rank, barrier,
                                        1, tp=2, zero_stage=3),
            "pp2dp2zero1<-single": _resume("3d", f"{root}/S/step-4", f"{root}/PZ", rank, barrier,
                                           1, pp=2, zero_stage=1)}


def test_exact_resume_every_layout_and_reshard(tmp_path):
    root = str(tmp_path)
    ref_losses, ref_params = _train(_cfg("single", f"{root}/S"))     # saves 2, 4, 6
    nothing = lambda: None                                              # noqa: E731
    runs = run_world(_world4, 4, root, timeout=240)[0]
    runs.update(run_world(_world, 2, root, timeout=240)[0])
    runs["single"] = (ref_losses[4:], ref_params,
                      *_resume("single", f"{root}/S/step-4", f"{root}/S1", 0, nothing))
    # one process's replicas (dp): from single's step 2 (saves 4), and single again from it
    runs["dp<-single"] = _resume("dp", f"{root}/S/step-2", f"{root}/DP", 0, nothing,
                                 replicas=2)
    for name in [*EXACT, "zero3", "ddp", "single"]:
        la, pa, lb, pb = runs[name]
        assert lb == la, f"{name}: resumed losses {lb} vs uninterrupted {la}"
        for key in pa:
            assert torch.equal(pa[key], pb[key]), f"{name}: {key} differs after the resume"
    why = "fp32: another layout sums the gradients in another order (tests/reference.py)"
    chain = {"zero3<-single": 2, "ddp<-zero3w4": 4, "tp2<-single": 4, "tp2sp<-single": 4,
             "ps<-single": 2, "cp2<-single": 4,
             "zero3w4<-single": 2, "tp2pp2<-zero3w4": 4, "zero3tp2<-single": 4,
             "pp2dp2zero1<-single": 4, "pp2dp2ddp<-single": 4, "dp<-single": 2}
    for name, start in chain.items():
        losses, params = runs[name]
        assert_close_runs(losses, ref_losses[start:], params, ref_params, RTOL, ATOL,
                          f"{name}: {why}")
    # ddp -> single, tp2 -> single, tp2 + sp -> single, cp2 -> single, tp2 x pp2 -> single,
    # pp2 x dp2 ZeRO-1 -> single, ps -> single, dp -> single
    for src in ("D/step-5", "T/step-5", "TS/step-5", "CP/step-5", "P/step-5", "PZ/step-5",
                "PS/step-4", "DP/step-4"):
        losses, params = _resume("single", f"{root}/{src}", f"{root}/from-{src.split('/')[0]}",
                                 0, nothing)
        start = int(src.rsplit("-", 1)[1])
        assert_close_runs(losses, ref_losses[start:], params, ref_params, RTOL, ATOL,
                          f"{src} -> single: {why}")
