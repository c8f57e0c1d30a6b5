"""Tensor parallelism builds its layers on the weights' own device (issue 31).

On CUDA, ``index_select`` refuses an index on another device, so slicing a full weight that
``split_from_rank0`` has already moved to the GPU with a CPU index crashed every tp layout at
setup. CPU kernels accept the mix, so these tests enforce CUDA's rule on any device with a
dispatch mode (:class:`SameDevice`: every tensor an op reads is on one device, a 0-dim CPU scalar
excepted, as CUDA allows) and build the layers from weights on the ``meta`` device: a CPU index
anywhere in the construction is then an error, as it is on a GPU. No collective runs while
layers are built, so a group of two ranks with no process group stands in for tp = 2.
"""
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from reference import tiny_config
from shardwise.comm.collectives import Comm, Group
from shardwise.memory.lora import inject_lora
from shardwise.models import build_model
from shardwise.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, ShardSpec,
                                       TensorPlan, VocabParallelEmbedding, apply_tensor_parallel,
                                       shard_tensor)

pytestmark = pytest.mark.timeout(120)
META = torch.device("meta")
TP = 2


class SameDevice(TorchDispatchMode):
    """CUDA's device rule on every device: an op whose tensors sit on two devices fails."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        devices = {str(t.device) for t in tree_flatten((args, kwargs))[0]
                   if isinstance(t, torch.Tensor)
                   and not (t.device.type == "cpu" and t.dim() == 0)}
        if len(devices) > 1:
            raise RuntimeError(f"{func}: tensors on {sorted(devices)} (CUDA refuses this)")
        return func(*args, **kwargs)


def _tp_rank(rank: int) -> tuple[SimpleNamespace, Group]:
    group = Group(pg=None, ranks=tuple(range(TP)), rank=rank)
    return SimpleNamespace(tp_group=group), group


def test_same_device_mode_catches_a_cpu_index_on_a_meta_weight():
    """The check itself: without it, torch accepts this mix on meta (and on CPU)."""
    w = torch.empty(6, 4, device=META)
    assert w.index_select(0, torch.arange(3)).device == META
    with SameDevice(), pytest.raises(RuntimeError, match="CUDA refuses"):
        w.index_select(0, torch.arange(3))


@pytest.mark.parametrize("rank", range(TP))
def test_shard_tensor_slices_on_the_weights_device(rank):
    spec = ShardSpec(0, 5, parts=3)                           # qkv-like: 3 interleaved parts
    with SameDevice():
        piece = shard_tensor(torch.empty(15, 4, device=META), spec, rank, TP)
    assert piece.device == META and piece.shape == (3 * (3 - rank), 4)
    whole = torch.arange(15.0)[:, None].expand(15, 4)          # same rows on CPU, by value
    rows = [j * 5 + i for j in range(3) for i in ((0, 1, 2) if rank == 0 else (3, 4))]
    torch.testing.assert_close(shard_tensor(whole, spec, rank, TP), whole[rows])


def test_layers_build_from_meta_weights():
    comm = Comm(device=META)
    _, group = _tp_rank(1)
    with SameDevice():
        col = ColumnParallelLinear(nn.Linear(8, 12, device=META), comm, group, parts=3)
        row = RowParallelLinear(nn.Linear(12, 8, device=META), comm, group)
        emb = VocabParallelEmbedding(nn.Embedding(67, 8, device=META), comm, group)
    assert col.weight.shape == (6, 8) and col.bias.shape == (6,)
    assert row.weight.shape == (8, 6) and emb.weight.shape == (33, 8)
    assert all(p.device == META for m in (col, row, emb) for p in m.parameters())


def _meta_gpt(lora: bool = False) -> nn.Module:
    model = build_model(tiny_config().model, seed=0)
    if lora:
        inject_lora(model, 4, 8.0, "*attn.qkv,*attn.proj,*mlp.fc")
    return model.to(META)


@pytest.mark.parametrize("lora", [False, True], ids=["gpt", "gpt-lora"])
def test_apply_tensor_parallel_on_device_weights(lora):
    """The whole model, as split_from_rank0 hands it over (already on the run's device)."""
    model = _meta_gpt(lora)
    mesh, group = _tp_rank(1)
    with SameDevice():
        specs = apply_tensor_parallel(model, mesh, Comm(device=META))
    assert specs and all(p.device == META for p in model.parameters())
    qkv = model.blocks[0].attn.qkv
    if lora:
        assert qkv.lora_B.shape == (3 * 32 // TP, 4)
        assert model.blocks[0].attn.proj.lora_A.shape == (4, 32 // TP)
    else:
        assert qkv.weight.shape == (3 * 32 // TP, 32)


def test_tensor_plan_piece_on_device_weights():
    """The checkpoint's reshard path cuts this rank's piece of a whole tensor the same way."""
    _, group = _tp_rank(0)
    plan = TensorPlan({"w": ShardSpec(0, 67)}, Comm(device=META), group)
    with SameDevice():
        piece = plan.piece("w", torch.empty(67, 8, device=META))
    assert piece.device == META and piece.shape == (34, 8)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_apply_tensor_parallel_on_hf_models(family):
    pytest.importorskip("transformers")
    import models_hf
    model = getattr(models_hf, f"tiny_{family}")(0).to(META)
    mesh, _ = _tp_rank(1)
    with SameDevice():
        specs = apply_tensor_parallel(model, mesh, Comm(device=META))
    assert specs and all(p.device == META for p in model.parameters())
