"""The planner's communication buffers (shardwise/planner/buffers.py) against the ledgers of real
runs: a small GPT (2 x 64, seq 32, batch 4, fp32 AdamW) trains two steps in a forked gloo world
of two ranks under each data-parallel stage and a pipeline, and the planner, told the path the
run took (the backend copies: gloo; shared memory: whether the rank's reducer or pipeline
transport mapped it), must give the ledger's ``comm_buffers`` of its fullest rank.

Tolerance 1%: the formulas count what the components allocate, byte for byte, except the padding
of each flat chunk to a multiple of N elements and the qkv bias the planner's GPT counts and
shardwise's GPT does not (3h elements per block: 0.3% of a block here). HF Llama (2 x 64)
runs ZeRO-2 too: its norms, registered after the matrices but used before them, keep a bucket
open beside the next ones (planner/buffers.py's replay of backward).
"""
import importlib.util
from dataclasses import replace

import pytest

from shardwise.bench.harness import gpt_bench_config
from shardwise.bench.validate_planner_heldout import spec_of
from shardwise.launch import auto as autoplan
from shardwise.launch.world import run_world
from shardwise.planner import Hardware, Layout
from shardwise.planner.buffers import plan_buckets, shared_bytes
from shardwise.planner.memory import buffer_parts, memory

MODEL = {"n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32}
TOL = 0.01
# strategy -> (parallel overrides, the planner's layout at batch 4)
CASES = {
    "ddp": ({}, Layout(dp=2, micro_batch=2)),
    "zero1": ({}, Layout(dp=2, zero=1, micro_batch=2)),
    "zero2": ({"bucket_mb": 0.03},
              Layout(dp=2, zero=2, micro_batch=2, bucket_bytes=int(0.03 * 2**20))),
    "zero3": ({}, Layout(dp=2, zero=3, micro_batch=2)),
    "pp": ({"pp": 2, "num_microbatches": 2}, Layout(pp=2, micro_batch=2)),
    # HF Llama registers its norms after the matrices it uses them before: buckets stay open
    "zero2-llama": ({"bucket_mb": 0.03},
                    Layout(dp=2, zero=2, micro_batch=2, bucket_bytes=int(0.03 * 2**20))),
}
if importlib.util.find_spec("transformers") is None:      # shardwise[hf] not installed
    del CASES["zero2-llama"]
LLAMA = {"name": "hf:llama", "n_layer": 2, "n_embd": 64, "n_head": 2, "block_size": 32}


def _config(name: str):
    par, _ = CASES[name]
    strategy, _, family = name.partition("-")
    return gpt_bench_config(strategy, parallel=par, model=LLAMA if family else MODEL,
                            train={"steps": 2, "batch_size": 4})


def _rank(rank: int, world: int, names: list[str]) -> dict:
    """Each strategy in turn, in this one world: its ledger and the shared-memory path taken."""
    import shardwise
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.api import optimizer_factory
    from shardwise.run.runtime import init_runtime
    out = {}
    for name in names:
        cfg = _config(name)
        rt = init_runtime(cfg)
        data = build_data(cfg)
        engine = shardwise.prepare(build_model(cfg.model, cfg.train.seed), optimizer_factory(cfg),
                                   cfg, loss_fn=loss_for(cfg.model), runtime=rt)
        index, count = engine.strategy.data_shard()
        for step in range(cfg.train.steps):
            engine.train_step(*data.batch(step, cfg.train.batch_size, index, count))
        s = engine.strategy
        sync = getattr(s, "grads", s)            # DDP's reducer, ZeRO's collectives
        reducer = getattr(sync, "reducer", None) or getattr(sync, "collectives", None)
        executor = getattr(s, "executor", None)
        shared = bool(reducer is not None and reducer.uses_shared_memory) or bool(
            executor is not None and executor.transport is not None)
        out[name] = {"ledger": dict(s.memory_ledger()), "shared": shared,
                     "pp_rank": rt.mesh.pp_rank}
        engine.close()
    return out


@pytest.fixture(scope="module")
def ledgers():
    return run_world(_rank, 2, list(CASES), timeout=240)


def _hardware(shared: bool) -> Hardware:
    return Hardware(nodes=1, devices_per_node=2, memory_bytes=8 * 2**30, peak_flops=1e10,
                    intra_bw=1e9, inter_bw=1e9, collective_copies=1.0,
                    allreduce_bw=2e9 if shared else 0.0)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(CASES))
def test_predicted_comm_buffers_match_the_ledger(ledgers, name):
    cfg = _config(name)
    layout = CASES[name][1]
    ranks = [r[name] for r in ledgers]
    m = memory(layout, spec_of(cfg), _hardware(ranks[0]["shared"]), autoplan.batch_of(cfg))
    mine = [r for r in ranks if m.role != "last stage" or r["pp_rank"] == 1]
    measured = max(r["ledger"]["comm_buffers"] for r in mine)
    assert measured > 0
    assert m.device["buffers"] == pytest.approx(measured, rel=TOL)


def test_zero2_holds_its_two_largest_neighbouring_buckets():
    """Several buckets (25 KiB here): the peak is one filling and one reducing, each with gloo's
    copy: 2 x (B_i + B_{i+1}); the buckets are comm/buckets.plan_buckets' (closed at >= cap)."""
    assert plan_buckets([5, 5, 5, 5, 5], 9) == [[4, 3], [2, 1], [0]]
    spec = autoplan.model_spec(_config("zero2"))
    layout = CASES["zero2"][1]
    parts = buffer_parts(spec, layout, autoplan.batch_of(_config("zero2")), spec.params, 1.0)
    assert parts["staging"] < 4 * spec.params / 2            # not the whole gradient
    assert parts["backend"] == pytest.approx(parts["staging"])


def test_pipeline_rings_by_stage_count():
    """comm/shm_p2p.py: two rings per rank at pp = 2, four from pp = 3 (the wrap-around pair),
    each twice an fp32 boundary activation rounded to pages (64 KiB .. 4 MiB) + two counters;
    none without the same-host path."""
    spec = autoplan.model_spec(_config("pp"))
    lay = Layout(pp=2, micro_batch=2)
    ring = 2 * 4 * 2 * spec.seq_len * spec.hidden          # 2 messages of (2, 32, 64) fp32
    ring = max(ring, 64 << 10)
    assert shared_bytes(spec, lay, True) == 2 * (ring + 128)
    assert shared_bytes(spec, replace(lay, pp=4), True) == 4 * (ring + 128)
    assert shared_bytes(spec, lay, False) == 0.0
    big = replace(spec, hidden=8192, heads=64)
    assert shared_bytes(big, lay, True) == 2 * ((4 << 20) + 128)   # capped at 4 MiB


from hypothesis import given, settings, strategies as st  # noqa: E402


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(1, 64), max_size=24), st.integers(-1, 200))
def test_the_planners_bucket_plan_is_the_runtimes(sizes, cap):
    """planner/buffers.py keeps its own copy of comm/buckets.plan_buckets (the planner stands
    alone: no torch, no shardwise.comm); the copy must group every size list as the runtime
    does, so the buffers it predicts are the ones DDP and ZeRO-1/2 allocate."""
    from shardwise.comm.buckets import plan_buckets as runtime
    assert plan_buckets([float(s) for s in sizes], float(cap)) == runtime(sizes, cap)
