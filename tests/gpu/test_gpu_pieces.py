"""The memory techniques, checkpoints and generation on one GPU (worlds of one over NCCL).

- offload: ZeRO-1 / ZeRO-3 with ``memory.offload = cpu`` keep masters and Adam states in pinned
  host memory and step there; equal to ``single`` on the GPU (fp32: rtol / atol 1e-5, the CPU
  step is the same Adam arithmetic on the same fp32 values).
- 8-bit Adam: shardwise's own AdamW8bit on CUDA tensors (never a silent substitute), its state
  keys the same under ``single``, ZeRO-2 and on the CPU. ``single`` on the GPU near ``single`` on
  the CPU (losses rtol 2e-3, parameters 2e-2 apart in relative L2: other matmul kernels flip a few
  8-bit codes). ZeRO-2's losses near ``single``'s (rtol 2e-3); its parameters are not compared:
  the quantisation blocks follow ZeRO's flat buffer, so a block can span two parameters of very
  different scales, and on CPU too the attention weights end 95% apart in relative L2 after 8
  steps (a known property of flat-buffer blocks, README "8-bit Adam").
- checkpoints: a run saving at steps 2 and 4 over NCCL, resumed from step 2, equals the run that
  went on (rtol / atol 1e-5: the embedding's backward adds with atomics, so a GPU rerun is not
  bit-exact); the stop flag the ranks agree on every step lives on the GPU.
- generate: ``shardwise generate`` on the GPU gives the same greedy text as on the CPU.
"""
import os
import shutil
from dataclasses import replace

from gpu_common import (DEVICE, SOLO_BACKEND, assert_close, assert_near, config, marks, single_reference,
                        train_on_device)
from shardwise.launch.world import run_world

pytestmark = marks(900)


def _offload(rank, n):
    out = {}
    for name, strategy in {"zero1-offload": "zero1", "zero3-offload": "zero3"}.items():
        cfg = config(strategy)
        out[name] = train_on_device(replace(cfg, memory=replace(cfg.memory, offload="cpu")))
    return out


def test_offload_equals_single():
    ref = run_world(single_reference, 1, [config()], timeout=300)[0][0]
    for name, got in run_world(_offload, 1, backend=SOLO_BACKEND, timeout=600)[0].items():
        assert_close(got, ref, 1e-5, 1e-5, why=f"fp32, {name}")


def _eight_bit(rank, n):
    from shardwise.memory.optim8bit import AdamW8bit
    from shardwise.run.runtime import init_runtime
    from shardwise.run.train import train
    out = {}
    for name, strategy, device in (("single", "single", DEVICE), ("zero2", "zero2", DEVICE),
                                   ("single-cpu", "single", "cpu")):
        cfg = config(strategy)
        cfg = replace(cfg, train=replace(cfg.train, optimizer="adamw8bit", device=device))
        summary = train(cfg, init_runtime(cfg), quiet=True)
        engine = summary["engine"]
        opts = [o for o in _optimizers(engine.optimizer)]
        keys = sorted({k for o in opts for st in o.state.values() for k in st})
        out[name] = (summary["losses"],
                         {k: v.detach().float().cpu() for k, v in engine.full_state_dict().items()},
                         sorted({p.device.type for p in engine.model.parameters()}),
                         all(isinstance(o, AdamW8bit) for o in opts), keys)
        engine.close()
    return out


def _optimizers(opt):
    """The torch optimizers inside a strategy's optimizer (ZeRO wraps its own)."""
    import torch
    if isinstance(opt, torch.optim.Optimizer):
        yield opt
    for attr in ("inner", "optimizer", "_optimizer", "base"):
        inner = getattr(opt, attr, None)
        if inner is not None and inner is not opt:
            yield from _optimizers(inner)
            return


def test_adamw8bit_is_shardwise_own_on_cuda():
    out = run_world(_eight_bit, 1, backend=SOLO_BACKEND, timeout=600)[0]
    single, zero2, cpu = out["single"], out["zero2"], out["single-cpu"]
    assert single[3] and zero2[3], "--optimizer adamw8bit must be shardwise's AdamW8bit"
    assert single[4] == zero2[4] == cpu[4], f"state keys differ: {single[4]}, {zero2[4]}, {cpu[4]}"
    assert_near(single[:3], cpu[:2], 2e-3, 2e-2, why="8-bit Adam on the device vs the CPU")
    losses = zero2[0]
    assert all(abs(a - b) <= 2e-3 * abs(b) for a, b in zip(losses, single[0])), (losses, single[0])


def _checkpoints(rank, n, root):
    a, b = f"{root}/a", f"{root}/b"

    def cfg(folder, resume):
        c = config("ddp", steps=4)
        return replace(c, train=replace(c.train, checkpoint_dir=folder, checkpoint_every=2,
                                        resume=resume))
    la, pa, _ = train_on_device(cfg(a, False))
    from shardwise.checkpoint import store
    os.makedirs(b)
    shutil.copytree(f"{a}/step-2", f"{b}/step-2")
    store._write_atomic(os.path.join(b, store.LATEST), "step-2\n")
    lb, pb, kinds = train_on_device(cfg(b, True))
    return la[2:], pa, lb, pb, kinds


def test_checkpoint_resume_over_nccl(tmp_path):
    la, pa, lb, pb, kinds = run_world(_checkpoints, 1, str(tmp_path), backend=SOLO_BACKEND,
                                      timeout=400)[0]
    assert_close((lb, pb, kinds), (la, pa), 1e-5, 1e-5, why="resumed over NCCL")


def test_generate_on_the_gpu_matches_cpu(tmp_path):
    """Train 6 steps on the GPU through the CLI, then ``shardwise generate`` greedily with
    ``--device`` the GPU and the CPU: the same text (each command a fresh process, as a user runs
    them)."""
    import subprocess
    import sys
    text = tmp_path / "corpus.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40)
    cli = [sys.executable, "-m", "shardwise.cli"]
    done = subprocess.run(cli + [
        "train", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head", "2",
        "--block-size", "16", "--dataset", "text", "--data-path", str(text), "--token-cache",
        str(tmp_path / "cache"), "--strategy", "single", "--steps", "6", "--batch-size", "4",
        "--lr", "1e-2", "--device", DEVICE, "--out-dir", str(tmp_path), "--run-name", "r",
        "--no-progress", "--eval-every", "0"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    texts = []
    for device in (DEVICE, "cpu"):
        out = subprocess.run(cli + ["generate", "--run", str(tmp_path / "r"), "--prompt",
                                    "the quick", "--max-new-tokens", "12", "--temperature", "0",
                                    "--device", device], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        texts.append(out.stdout)
    assert texts[0] == texts[1] and texts[0].startswith("the quick"), texts


def _replica_pieces(rank, n, path):
    """Replica groups' two exchanges on the device: a joining group's state broadcast over
    its own world (on the run's device: NCCL moves device tensors only; here gloo, staged
    through the host) and the lane's sum of a device flat over the gloo link (in a host copy:
    gloo aborts on GPU memory)."""
    import torch
    import torch.distributed as dist
    from shardwise.comm.collectives import Comm, CommMeter, Group
    from shardwise.comm.replicas import ReplicaLink, broadcast_state
    comm = Comm(device=DEVICE, check_devices=True)
    group = Group(dist.group.WORLD, tuple(range(n)), rank)
    got = broadcast_state(comm, group, {"w": torch.arange(4.0)} if rank == 0 else None)
    link = ReplicaLink(dist.FileStore(path, n), 0, 0, rank, n, 60, CommMeter())
    flat = torch.full((3,), float(rank + 1), device=DEVICE)
    ok = link.all_reduce_sum(flat)
    return got["w"].tolist(), ok, flat.device.type, flat.cpu().tolist()


def test_replica_groups_exchange_device_tensors(tmp_path):
    """``--ft-replicas`` on a GPU: the state broadcast and the lane's sum take CUDA tensors
    (two ranks on the one GPU over gloo)."""
    for state, ok, kind, flat in run_world(_replica_pieces, 2, str(tmp_path / "store"),
                                           timeout=120):
        assert state == [0.0, 1.0, 2.0, 3.0] and ok and flat == [3.0, 3.0, 3.0]
        assert kind == DEVICE
