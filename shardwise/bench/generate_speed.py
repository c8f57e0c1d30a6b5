"""Generation speed with and without the key-value cache (shardwise/models/decode.py).

    python -m shardwise.bench.generate_speed --out shardwise/bench/results \\
        [--model gpt --n-layer 4 --n-embd 256 --n-head 4 --block-size 640 --prompt-len 64
         --new-tokens 512 --repeats 3 --threads 1]

One model of random weights (seeded), one prompt of random tokens, greedy decoding of
``--new-tokens`` tokens, ``--repeats`` times each way after a short warm-up; the median wall time
of each way, tokens/s, their ratio, and whether both ways chose the same tokens (they must).
Writes ``generate-kv-cache-vs-none.json`` into ``--out`` with the machine, commit, dirty flag
and date (shardwise/bench/run.py's ``machine``) and the command line.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

from shardwise.bench.run import machine
from shardwise.config import ModelConfig
from shardwise.models import build_model
from shardwise.models.decode import sample_batch

RESULT = "generate-kv-cache-vs-none.json"


def _args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m shardwise.bench.generate_speed",
                                 description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="folder for the result JSON")
    ap.add_argument("--model", default="gpt", choices=("gpt", "hf:gpt2", "hf:llama"))
    ap.add_argument("--n-layer", type=int, default=4)
    ap.add_argument("--n-embd", type=int, default=256)
    ap.add_argument("--n-head", type=int, default=4)
    ap.add_argument("--block-size", type=int, default=640)
    ap.add_argument("--vocab-size", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch.set_num_threads (default 1: steady on a shared CPU)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.prompt_len < 1 or args.new_tokens < 1 or args.repeats < 1:
        ap.error("--prompt-len, --new-tokens and --repeats must be at least 1")
    if args.prompt_len > args.block_size:
        ap.error(f"--prompt-len {args.prompt_len} is longer than --block-size "
                 f"{args.block_size}; give a shorter prompt")
    return args


def _timed(model, prompt: list[int], n: int, window: int, cache: bool) -> tuple[float, list]:
    start = time.perf_counter()
    tokens = sample_batch(model, [prompt], n, window, 0.0, 0, 0, cache)[0]
    return time.perf_counter() - start, tokens


def measure(args: argparse.Namespace) -> dict:
    """Both ways, ``repeats`` times each (alternating, so that a change in the machine's load
    falls on both), after a warm-up of 8 tokens each."""
    torch.set_num_threads(args.threads)
    cfg = ModelConfig(name=args.model, n_layer=args.n_layer, n_embd=args.n_embd,
                      n_head=args.n_head, block_size=args.block_size,
                      vocab_size=args.vocab_size)
    model = build_model(cfg, args.seed).eval()
    g = torch.Generator().manual_seed(args.seed)
    prompt = torch.randint(0, args.vocab_size, (args.prompt_len,), generator=g).tolist()
    for cache in (True, False):
        _timed(model, prompt, 8, args.block_size, cache)
    seconds: dict[bool, list[float]] = {True: [], False: []}
    tokens: dict[bool, list] = {}
    for _ in range(args.repeats):
        for cache in (True, False):
            s, tokens[cache] = _timed(model, prompt, args.new_tokens, args.block_size, cache)
            seconds[cache].append(round(s, 4))
    way = {}
    for cache, name in ((True, "cache"), (False, "no_cache")):
        median = statistics.median(seconds[cache])
        way[name] = {"seconds": seconds[cache], "median_s": round(median, 4),
                     "tokens_per_s": round(args.new_tokens / median, 1)}
    return {"name": "generate: KV cache vs recomputing the window",
            "model": {"name": args.model, "n_layer": args.n_layer, "n_embd": args.n_embd,
                      "n_head": args.n_head, "block_size": args.block_size,
                      "vocab_size": args.vocab_size,
                      "params": sum(p.numel() for p in model.parameters())},
            "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
            "repeats": args.repeats, "threads": args.threads, "decoding": "greedy, batch 1",
            **way, "speedup": round(way["no_cache"]["median_s"] / way["cache"]["median_s"], 2),
            "same_tokens": tokens[True] == tokens[False]}


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    result = measure(args)
    result["command"] = "python -m shardwise.bench.generate_speed " + " ".join(
        sys.argv[1:] if argv is None else argv)
    result["machine"] = machine()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, RESULT)
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=2)
        fh.write("\n")
    print(f"cache {result['cache']['tokens_per_s']} tokens/s, no cache "
          f"{result['no_cache']['tokens_per_s']} tokens/s: {result['speedup']}x, same tokens: "
          f"{result['same_tokens']} -> {path}")
    return 0 if result["same_tokens"] else 1


if __name__ == "__main__":
    sys.exit(main())
