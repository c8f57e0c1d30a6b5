"""torch's own context parallelism on this CPU: does it run? (the peer the cp rows lack)

    python -m shardwise.bench.torch_cp_cpu --save     # results/torch-context-parallel-cpu.json

In a forked gloo world of 2 on CPU, ``torch.distributed.tensor.experimental.context_parallel``
shards q, k and v (B, h, S, d) along the sequence and runs causal
``scaled_dot_product_attention`` under it, as its documentation shows. The CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``) has no sharding rule, so torch raises
(pytorch/pytorch#147793); the first line of what each rank raised (or "ran") is recorded with
the machine, the commit and the date, and docs/model-parallel.md quotes it from the JSON. The
same attention under shardwise's ``--cp 2`` is tests/parallel/test_context_parallel.py's.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from shardwise.launch.world import run_world


def _rank(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    mesh = init_device_mesh("cpu", (world,))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 256, 8, generator=g) for _ in range(3))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return "ran"
    except Exception as exc:          # what a user sees, whatever it is
        first = str(exc).splitlines()[0] if str(exc) else ""
        return f"{type(exc).__name__}: {first}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.torch_cp_cpu",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--save", action="store_true", help="write the result JSON")
    args = ap.parse_args(argv)
    outcome = run_world(_rank, 2, timeout=120)
    line = outcome[0] if len(set(outcome)) == 1 else " / ".join(outcome)
    print(f"torch context_parallel, gloo, CPU, world 2: {line}")
    if args.save:
        from shardwise.bench.run import RESULTS, machine
        table = ("| implementation | world, device | causal sdpa under it |\n|---|---|---|\n"
                 f"| torch.distributed.tensor.experimental.context_parallel | 2, CPU (gloo) | "
                 f"{line.replace('|', '/')} |\n")
        path = os.path.join(RESULTS, "torch-context-parallel-cpu.json")
        with open(path, "w") as f:
            json.dump({"outcome": outcome, "table": table, "machine": machine()}, f, indent=1)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
