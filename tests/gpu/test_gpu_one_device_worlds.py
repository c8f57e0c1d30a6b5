"""Several ranks on one GPU: worlds of 2-4 processes over gloo whose model, activations and
gradients live on the GPU, equal to ``single`` on that GPU.

NCCL refuses two ranks on one device, and gloo aborts the process when handed CUDA tensors (seen
on the H200: ``gloo::IoException ... writev: Bad address``), so these worlds run shardwise's own
host staging (comm/collectives.py): every collective copies its CUDA tensors into host buffers,
runs on gloo and copies the result back. That exercises everything a multi-GPU run does on
CUDA tensors (TP layers sharded from full weights, ZeRO-3 gathers and reduce-scatters into GPU
buffers, pipeline sends of GPU activations, the parameter server's messages, checkpoints of
sharded GPU state) except NCCL's own transport, which a one-GPU machine cannot show.

Tolerance (fp32): rtol 1e-4 / atol 1e-4. On CPU the layouts match to 1e-5
(tests/reference.py); on a GPU cuBLAS picks its kernels per matrix shape (TP's halves, a pipeline
stage's micro-batches), and with them how each dot product is split and summed, and the
embedding's backward adds rows with atomics in no fixed order. 1e-4 is still 1% of one Adam step
at lr 1e-2, where a wrong shard or a missing average moves parameters by whole steps.
"""
import os
import shutil
from dataclasses import replace

from gpu_common import assert_close, config, marks, single_reference, train_on_device
from shardwise.launch.world import run_world

pytestmark = marks(900)
RTOL = ATOL = 1e-4
WHY = "fp32 on CUDA: cuBLAS kernels per shape, atomic embedding backward"
WORLD2 = {"ddp": ("ddp", {}), "zero2": ("zero2", {}), "zero3": ("zero3", {}),
          "tp2": ("tp", {"tp": 2}), "pp2": ("pp", {"pp": 2}),
          "zero3-tp2": ("3d", {"tp": 2, "zero_stage": 3})}
WORLD4 = {"3d-pp2-tp2": ("3d", {"pp": 2, "tp": 2}), "3d-pp2-dp2-zero1": ("3d", {"pp": 2, "zero_stage": 1})}


def _layouts(rank, n, table):
    out = {}
    for name, (strategy, fields) in table.items():
        try:
            out[name] = ("ok", train_on_device(config(strategy, **fields)))
        except Exception as exc:
            out[name] = ("error", f"{type(exc).__name__}: {exc}")
    return out


def _compare(results, reference):
    failures = []
    for name, (status, got) in results[0].items():
        if status != "ok":
            failures.append(f"{name}: {got}")
            continue
        try:
            assert_close(got, reference, RTOL, ATOL, why=f"{WHY}; {name}")
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


def _reference():
    return run_world(single_reference, 1, [config()], timeout=300)[0][0]


def test_world_of_two_on_one_gpu():
    _compare(run_world(_layouts, 2, WORLD2, timeout=800), _reference())


def test_world_of_four_on_one_gpu():
    _compare(run_world(_layouts, 4, WORLD4, timeout=800), _reference())


def test_parameter_server_on_one_gpu():
    """One server and two workers (world 3); the workers' model and gradients on the GPU."""
    cfg = config("ps", num_ps=1, ps_timeout=60.0)
    ref = run_world(single_reference, 1, [cfg], timeout=300)[0][0]
    results = run_world(lambda rank, n: {"ps": ("ok", train_on_device(cfg))}, 3, timeout=600)
    _compare(results, ref)


def _checkpoint_pair(rank, n, root, strategy, fields):
    """An uninterrupted run saving at steps 2 and 4; a second run resumed from step 2."""
    import torch.distributed as dist
    a, b = f"{root}/a", f"{root}/b"

    def cfg(folder, resume):
        c = config(strategy, steps=4, **fields)
        return replace(c, train=replace(c.train, checkpoint_dir=folder, checkpoint_every=2,
                                        resume=resume))
    la, pa, _ = train_on_device(cfg(a, False))
    if rank == 0:
        from shardwise.checkpoint import store
        os.makedirs(b)
        shutil.copytree(f"{a}/step-2", f"{b}/step-2")
        store._write_atomic(os.path.join(b, store.LATEST), "step-2\n")
    dist.barrier()
    lb, pb, kinds = train_on_device(cfg(b, True))
    return la[2:], pa, lb, pb, kinds


def test_checkpoints_resume_on_one_gpu(tmp_path):
    """tp2 and zero3 on GPU tensors save sharded state and resume from it, equal to the run
    that went on (the same tolerance: atomics make a GPU rerun not bit-exact)."""
    for name, (strategy, fields) in {"tp2": ("tp", {"tp": 2}), "zero3": ("zero3", {})}.items():
        root = str(tmp_path / name)
        la, pa, lb, pb, kinds = run_world(_checkpoint_pair, 2, root, strategy, fields,
                                          timeout=400)[0]
        assert_close((lb, pb, kinds), (la, pa), RTOL, ATOL, why=f"{WHY}; resumed {name}")
