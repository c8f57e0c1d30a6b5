"""Foundation rows: shardwise's loop with the `single` strategy against a plain PyTorch loop,
on the same optimizer (the loop's own cost), and as a product: ``shardwise train`` with its
defaults against the loop a user writes with torch's defaults (``torch.optim.AdamW(params, lr)``,
whose CPU step is a loop over tensors; ours is fused: train.optimizer_kernel). And
``--compile`` against eager at the 57M GPT, for ``single`` and ``ddp`` (issue 35's goal:
>= 1.2x); the compiled side's first step (its compilation) is outside its tokens/s and in
``extra.compile_seconds``; the same in bf16 autocast (``-bf16``: the matrix products take
less than half their fp32 time on a CPU with AVX-512 BF16, so the rest, what Inductor fuses,
is a larger share of the step: docs/memory.md)."""
from dataclasses import replace

from shardwise.config.names import Strategy
from shardwise.bench.harness import Row, gpt_bench_config, sized_config
from shardwise.bench.peers import ours_tokens_per_s, plain_loop_tokens_per_s, step_ceiling


def ours(rank, world, steps):
    return ours_tokens_per_s(gpt_bench_config(Strategy.SINGLE, train={"steps": steps}), world)


def peer(rank, world, steps, size="3m"):
    """The plain loop on ours' optimizer (run/api.optimizer_factory: fused AdamW), at ``size``."""
    return {"items_per_s": plain_loop_tokens_per_s(_config(size), rank, world, steps=steps - 2)}


# the memory rows' GPT (8 x 768, 57.0M parameters), batch 4: the optimizer's share grows with it
GPT_57M = {"n_layer": 8, "n_embd": 768, "n_head": 12, "block_size": 128, "vocab_size": 256}


def _config(size: str, steps: int | None = None):
    train = {"steps": steps} if steps else {}
    if size == "57m":
        return gpt_bench_config(Strategy.SINGLE, model=GPT_57M, train={**train, "batch_size": 4})
    return gpt_bench_config(Strategy.SINGLE, train=train)


def ours_sized(rank, world, steps, size="3m"):
    return ours_tokens_per_s(_config(size, steps), world)


def peer_torch_defaults(rank, world, steps, size="3m"):
    """torch's defaults; ``extra`` holds the optimizer step's share of its step (the row's goal:
    ours >= 1 + that share, since ours steps the same AdamW fused), the fused step's own time on
    the same model (``ours_optimizer_step_s``) and what swapping the one for the other can give
    at most (``step_ceiling``: ``ceiling``, ``goal``, ``replacement_limit_s``)."""
    timings: dict = {}
    items = plain_loop_tokens_per_s(_config(size), rank, world, steps=steps - 2,
                                    torch_defaults=True, timings=timings)
    share = timings["optimizer_step_s"] / timings["step_s"]
    bound = step_ceiling(timings["step_s"], timings["optimizer_step_s"],
                         timings["ours_optimizer_step_s"])
    return {"items_per_s": items, "extra": {**timings, "optimizer_share": share, **bound}}


def _compiled(strategy: str, steps: int, compiled: bool, precision: str = "no"):
    cfg = sized_config(strategy, "57m", steps)
    return replace(cfg, memory=replace(cfg.memory, compile=compiled, mixed_precision=precision))


def ours_compiled(rank, world, steps, strategy=Strategy.SINGLE, precision="no"):
    return ours_tokens_per_s(_compiled(strategy, steps, True, precision), world)


def ours_eager(rank, world, steps, strategy=Strategy.SINGLE, precision="no"):
    return ours_tokens_per_s(_compiled(strategy, steps, False, precision), world)


ROWS = [Row("single-vs-torch", ours, peer, world=1, args={"steps": 14},
            quick_args={"steps": 6},
            goal="ratio >= 0.98 (the loop costs nothing)", peer_name="plain PyTorch loop"),
        Row("single-vs-torch-57m", ours_sized, peer, world=1,
            args={"steps": 8, "size": "57m"}, quick_args={"steps": 5, "size": "57m"},
            goal="ratio >= 0.98 (the loop costs nothing)", peer_name="plain PyTorch loop"),
        Row("single-defaults-vs-torch-defaults", ours_sized, peer_torch_defaults, world=1,
            args={"steps": 14}, quick_args={"steps": 6},
            goal="ratio >= 1 + the optimizer step's share of torch's step",
            peer_name="plain PyTorch loop, torch.optim.AdamW(params, lr)",
            peer_allocator="system"),
        Row("single-defaults-vs-torch-defaults-57m", ours_sized, peer_torch_defaults, world=1,
            args={"steps": 8, "size": "57m"}, quick_args={"steps": 5, "size": "57m"},
            goal="ratio >= 1 + the optimizer step's share of torch's step",
            peer_name="plain PyTorch loop, torch.optim.AdamW(params, lr)",
            peer_allocator="system"),
        Row("compile-vs-eager-57m", ours_compiled, ours_eager, world=1,
            args={"steps": 8}, quick_args={"steps": 5},
            goal="ratio >= 1.2 (--compile against eager)", peer_name="shardwise eager"),
        Row("compile-vs-eager-57m-bf16", ours_compiled, ours_eager, world=1,
            args={"steps": 8, "precision": "bf16"}, quick_args={"steps": 5, "precision": "bf16"},
            goal="ratio >= 1.2 (--compile against eager, both --mixed-precision bf16)",
            peer_name="shardwise eager"),
        Row("ddp-compile-vs-eager-57m", ours_compiled, ours_eager, world=2,
            args={"steps": 8, "strategy": Strategy.DDP}, quick_args={"steps": 5, "strategy": Strategy.DDP},
            goal="ratio >= 1.2 (--compile against eager)", peer_name="shardwise eager")]
