"""Pipeline parallelism: schedules as data and their checker, the stage split, training equal to
single under GPipe and 1F1B, and the executor's measured bubble and activations in flight.

Tolerance: fp32 rtol 1e-5 (atol 1e-5 on parameters). The pipeline accumulates the gradient of
each micro-batch's loss / m instead of one backward over the whole batch, so sums run in another
order; Adam can turn the last bits of a nearly cancelling gradient element into a small fraction
of lr (1e-2) over 10 steps: 1e-5 absolute is 1/1000 of lr.
"""
import os
from dataclasses import replace

import pytest
import torch

from harness import assert_close_runs, run_world
from reference import run, single_run, tiny_config
from shardwise.parallel.pipeline import schedule as sched
from shardwise.parallel.pipeline.schedule import Action, ScheduleError
from shardwise.parallel.pipeline.stage import balanced_bounds, parse_stage_layers

pytestmark = pytest.mark.timeout(300)
RTOL, ATOL = 1e-5, 1e-5
WHY = "fp32; micro-batch gradients accumulated in another order"


# -- schedules as data (no processes) ------------------------------------------------------------
@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 1), (2, 4), (4, 2), (4, 8), (3, 5)])
def test_ideal_bubble_is_the_formula_and_peaks_are_m_or_p(name, p, m):
    schedule = sched.build(name, p, m)
    assert sched.simulate(schedule, t_f=1.0, t_b=2.0)["bubble"] == pytest.approx(
        sched.bubble_formula(p, m), abs=1e-12)
    peaks = [sched.peak_in_flight(a) for a in schedule]
    if name == "gpipe":
        assert peaks == [m] * p
    else:
        assert peaks == [min(p - s, m) for s in range(p)] and max(peaks) <= p


def test_checker_rejects_broken_schedules():
    good = sched.one_f_one_b(2, 2)
    unbatched = [list(good[0]), [Action("RECV_F", 0), Action("F", 0), Action("B", 0),
                                 Action("SEND_B", 0), Action("RECV_F", 1), Action("F", 1),
                                 Action("B", 1), Action("SEND_B", 1)]]
    sched.check(unbatched, 2)      # legal: the simulation posts send F1 with receive B0
    swapped = [list(good[0]), list(good[1])]
    swapped[1][0], swapped[1][4] = swapped[1][4], swapped[1][0]       # RECV_F1 first
    with pytest.raises(ScheduleError):
        sched.check(swapped, 2)
    missing = [list(good[0]), [a for a in good[1] if a != Action("SEND_B", 1)]]
    with pytest.raises(ScheduleError, match="must receive|receives"):
        sched.check(missing, 2)
    # stage 0 waits for gradient 0 before sending activation 0: it waits on itself
    deadlock = [[Action("F", 0), Action("RECV_B", 0), Action("B", 0), Action("SEND_F", 0)],
                [Action("RECV_F", 0), Action("F", 0), Action("B", 0), Action("SEND_B", 0)]]
    with pytest.raises(ScheduleError, match="deadlock"):
        sched.check(deadlock, 1)


def test_stage_split_balanced_or_given():
    # embedding on stage 0 and head on the last weigh like blocks: 6 blocks of 10 cost
    assert balanced_bounds([10] * 6, 20, 0, 2) == [(0, 2), (2, 6)]
    assert balanced_bounds([10] * 4, 0, 0, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert parse_stage_layers("1,3", 4, 2) == [(0, 1), (1, 4)]
    with pytest.raises(ValueError):
        parse_stage_layers("2,3", 4, 2)


# -- real worlds ----------------------------------------------------------------------------------
def _configs(world, **parallel):
    base = tiny_config("pp", steps=10, **parallel)
    base = replace(base, logging=replace(base.logging, schedule_png="off"))
    return [replace(base, parallel=replace(base.parallel, schedule=s)) for s in ("gpipe", "1f1b")]


def _train_and_measure(rank, n, configs, png_dir):
    out = [run(cfg) for cfg in configs]
    from shardwise.run.api import optimizer_factory, prepare
    from shardwise.data import build_data
    from shardwise.models import build_model, loss_for
    from shardwise.run.runtime import init_runtime
    reports = {}
    for cfg in configs:       # one step at m = 1 and m = 4, per schedule: records of the executor
        for m in (1, 4):
            c = replace(cfg, parallel=replace(cfg.parallel, num_microbatches=m))
            rt = init_runtime(c)
            engine = prepare(build_model(c.model, 0), optimizer_factory(c), c,
                             loss_fn=loss_for(c.model), runtime=rt)
            x, y = build_data(c).batch(0, c.train.batch_size, *engine.strategy.data_shard())
            engine.train_step(x, y)
            png = os.path.join(png_dir, f"{c.parallel.schedule}-{m}.png") if m == 4 else None
            rep = engine.strategy.pipeline_report(png)
            reports[(c.parallel.schedule, m)] = (rep, engine.strategy.actions)
            with pytest.raises(RuntimeError, match="train_step"):
                engine.backward(torch.zeros(()))
    return out, reports


def _check(results, configs, p):
    expected = single_run(configs[0])
    for out, reports in results:
        for losses, params in out:
            assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why=WHY)
        for (name, m), (rep, actions) in reports.items():
            records = rep["records"]
            # each stage ran exactly its schedule, in order (transfers batched as posted)
            for s, rec in enumerate(records):
                ran = [(op, mb) for op, mb, _, _ in rec.records if op in ("F", "B")]
                planned = [(a.op, a.mb) for a in sched.build(name, p, m)[s] if a.op in ("F", "B")]
                assert ran == planned
            peaks = rep["peak_in_flight"]
            assert peaks == ([m] * p if name == "gpipe" else [min(p - s, m) for s in range(p)])
            assert max(peaks) <= (m if name == "gpipe" else p)
            # m = 1: every action waits for the one before, so at least (p-1)/p of the span idles;
            # 0.02 absorbs the clock reads around each action (microseconds in a ~50 ms step)
            if m == 1:
                assert rep["bubble_measured"] >= sched.bubble_formula(p, 1) - 0.02


def test_pp2_equals_single_gpipe_and_1f1b_with_measured_schedule(tmp_path):
    configs = _configs(2, pp=2)
    results = run_world(_train_and_measure, 2, configs, str(tmp_path))
    _check(results, configs, 2)
    assert os.path.getsize(tmp_path / "1f1b-4.png") > 1000


def test_pp4_and_dp2_pp2_equal_single():
    four = [replace(c, model=replace(c.model, n_layer=4),
                    parallel=replace(c.parallel, num_microbatches=2)) for c in _configs(4, pp=4)]
    results = run_world(lambda r, n, cs: [run(c) for c in cs], 4, four)
    expected = single_run(four[0])
    for out in results:
        for losses, params in out:
            assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why=WHY)
    two = _configs(4, pp=2, dp=2)
    expected = single_run(two[0])
    for out in run_world(lambda r, n, cs: [run(c) for c in cs], 4, two):
        for losses, params in out:
            assert_close_runs(losses, expected[0], params, expected[1], RTOL, ATOL, why=WHY)
