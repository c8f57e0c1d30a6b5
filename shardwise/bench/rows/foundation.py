"""Foundation row: shardwise's loop with the `single` strategy against a plain PyTorch loop."""
from shardwise.bench.harness import Row, gpt_bench_config
from shardwise.bench.peers import ours_tokens_per_s, plain_loop_tokens_per_s


def ours(rank, world, steps):
    return ours_tokens_per_s(gpt_bench_config("single", train={"steps": steps}), world)


def peer(rank, world, steps):
    cfg = gpt_bench_config("single")
    return {"items_per_s": plain_loop_tokens_per_s(cfg, rank, world, steps=steps - 2)}


ROWS = [Row("single-vs-torch", ours, peer, world=1, args={"steps": 14},
            quick_args={"steps": 6},
            goal="ratio >= 0.98 (the loop costs nothing)", peer_name="plain PyTorch loop")]
