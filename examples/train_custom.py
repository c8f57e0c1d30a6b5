"""Train a model you wrote yourself with shardwise, keeping your own training loop.

    torchrun --standalone --nproc-per-node 2 examples/train_custom.py               # DDP, 2 ranks
    torchrun --standalone --nproc-per-node 2 examples/train_custom.py --strategy zero2
    python examples/train_custom.py --strategy single                                # one process

Every rank builds the same model; shardwise broadcasts rank 0's weights, gives each rank its own
rows of each global batch, and keeps the replicas in step. The printed loss is rank 0's.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import shardwise
from shardwise.config import Config, ParallelConfig, TrainConfig


class MyNet(nn.Module):
    """Any nn.Module: here a small MLP that learns to add two 4-bit numbers given in binary."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(),
                                 nn.Linear(128, 31))

    def forward(self, x):
        return self.net(x)


def batch(step: int, size: int):
    g = torch.Generator().manual_seed(step)
    a, b = torch.randint(0, 16, (size,), generator=g), torch.randint(0, 16, (size,), generator=g)
    bits = lambda v: ((v[:, None] >> torch.arange(4)) & 1).float()
    return torch.cat([bits(a), bits(b)], dim=1), a + b


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--steps", type=int, default=300)
    args = ap.parse_args()
    cfg = Config(parallel=ParallelConfig(strategy=args.strategy), train=TrainConfig(batch_size=64))
    torch.manual_seed(0)
    engine = shardwise.prepare(MyNet(), lambda ps: torch.optim.AdamW(ps, lr=3e-3), cfg,
                               loss_fn=F.cross_entropy)
    for step in range(args.steps):
        x, y = engine.shard(*batch(step, 64))         # this rank's rows of the global batch
        loss = engine.loss_fn(engine(x), y)
        engine.backward(loss)                          # gradient traffic overlaps backward
        engine.step()
        if engine.mesh.rank == 0 and step % 50 == 0:
            print(f"step {step:4d}  loss {loss.item():.4f}")
    x, y = engine.shard(*batch(10_000, 512))
    acc = (engine(x).argmax(-1) == y).float().mean().item()
    if engine.mesh.rank == 0:
        print(f"accuracy on fresh sums (rank 0's rows): {acc:.3f}")
        print("traffic:", {k: v["bytes_sent"] for k, v in engine.meter.snapshot().items()})


if __name__ == "__main__":
    main()
