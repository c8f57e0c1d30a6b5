"""Every layout in a world of one over NCCL on one GPU, equal to ``single`` on that GPU.

A world of one is the path a one-GPU user takes (``torchrun --nproc-per-node 1`` / a launcher):
the process group is NCCL, every collective short-circuits at group size 1 (comm/collectives.py),
and what remains is each strategy's own machinery on CUDA tensors: flat buffers, ZeRO's shards
and units, the pipeline executor, TP layers built from the full weight, offload, the stop flag
that checkpoints agree on, the fp16 / bf16 autocast paths.

Tolerances (fp32): rtol 1e-5 / atol 1e-5, tests/reference.py's reason: flat buffers and units
change the order of a few sums. (bf16): losses rtol 2e-2 and the parameters' relative L2
distance <= 2e-2: bf16 keeps 8 mantissa bits (0.4% per rounding); the layouts round the same
products at other points (bucketed gradients, sharded masters), and Adam turns a flipped sign of a
near-zero gradient element into a full step, so element-wise closeness is not expected; a wrong
shard or a missing unit moves the loss by far more than 2%.
"""
import pytest

from gpu_common import SOLO_BACKEND, assert_close, assert_near, config, marks, single_reference, train_on_device
from shardwise.launch.world import run_world

pytestmark = marks(900)
LAYOUTS = [("ddp", {}), ("zero1", {}), ("zero2", {}), ("zero3", {}), ("tp", {"tp": 1}),
           ("pp", {"pp": 1}), ("3d", {})]


def _layouts(rank, n, precision):
    cfgs = [config(name, precision=precision, **fields) for name, fields in LAYOUTS]
    ref = single_reference(rank, n, cfgs[:1])[0]
    runs = []
    for cfg in cfgs:
        try:
            runs.append(("ok", train_on_device(cfg)))
        except Exception as exc:            # each layout reported on its own
            runs.append(("error", f"{type(exc).__name__}: {exc}"))
    return ref, runs


def _check(results, precision):
    ref, runs = results[0]
    failures = []
    for (name, _), (status, got) in zip(LAYOUTS, runs):
        if status != "ok":
            failures.append(f"{name}: {got}")
            continue
        try:
            if precision == "fp32":
                assert_close(got, ref, 1e-5, 1e-5, why=f"fp32, {name} in a world of one")
            else:
                assert_near(got, ref, 2e-2, 2e-2, why=f"bf16, {name} in a world of one")
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_every_layout_in_a_world_of_one(precision):
    _check(run_world(_layouts, 1, precision, backend=SOLO_BACKEND, timeout=800), precision)
