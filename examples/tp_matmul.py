"""The strategy guide's model-parallel matrix example, run for real on 2 processes.

x (4x5) times w (5x8): w is split on dimension 1 across 2 devices, each device computes
x @ w_r (4x4) on the full x, and the outputs are concatenated (an all-gather) into the 4x8
result, which equals x @ w. The same split, packaged as a layer, is shardwise's
ColumnParallelLinear (Megatron-LM's column-parallel linear), checked here too.

    python examples/tp_matmul.py
"""
from __future__ import annotations

import torch
import torch.nn as nn

from shardwise.comm.collectives import Comm
from shardwise.mesh import Mesh
from shardwise.parallel.tensor import ColumnParallelLinear
from shardwise.launch.world import run_world


def split_matmul(rank: int, world: int) -> dict:
    mesh = Mesh.build(tp=world)                   # the 2 processes form one tp group
    comm = Comm()
    torch.manual_seed(0)                          # the same x and w on both devices
    x, w = torch.randn(4, 5), torch.randn(5, 8)
    w_r = w.chunk(world, dim=1)[mesh.tp_rank]     # (5, 4): this device's columns of w
    out_r = x @ w_r                               # (4, 4): this device's half of the output
    gathered = torch.empty(world * 4, 8 // world)            # out_0 stacked over out_1
    comm.all_gather(gathered, out_r, mesh.tp_group)
    out = torch.cat(gathered.chunk(world), dim=1)  # (4, 8): concatenated on dimension 1
    # the same thing as a layer: nn.Linear(5, 8) has weight w^T; its column-parallel version
    linear = nn.Linear(5, 8, bias=False)
    with torch.no_grad():
        linear.weight.copy_(w.T)
    layer_out = ColumnParallelLinear(linear, comm, mesh.tp_group)(x)   # (4, 4) = out_r
    return {"x": x, "w": w, "out_r": out_r, "out": out, "layer_out": layer_out.detach(),
            "meter": comm.meter.snapshot()}


def main() -> None:
    results = run_world(split_matmul, 2)
    full = results[0]["x"] @ results[0]["w"]
    for rank, r in enumerate(results):
        print(f"device {rank}: x @ w[:, {4 * rank}:{4 * rank + 4}] has shape {tuple(r['out_r'].shape)}")
    same = all(torch.allclose(r["out"], full) for r in results)
    print(f"concatenated output {tuple(results[0]['out'].shape)} equals x @ w: {same}")


if __name__ == "__main__":
    main()
