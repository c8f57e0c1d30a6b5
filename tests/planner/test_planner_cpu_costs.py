"""What the planner charges for sharing a CPU (issue 17): a collective that follows compute
pays ``collective_overhead`` per call; ranks that outnumber the cores absorb part of a
pipeline's bubble (``compute_lanes``); a calibration carries both to the Hardware."""
from dataclasses import replace

import pytest

from shardwise.planner import Batch, Hardware, Layout, estimate
from shardwise.planner import comm
from shardwise.planner.model import ModelSpec

SPEC = ModelSpec(4, 256, 4, 128, 256, tied_embeddings=False)
BATCH = Batch(8, precision="fp32")


def _cpu(world: int, **more) -> Hardware:
    return Hardware.custom(nodes=1, devices_per_node=world, memory_bytes=8 * 2**30,
                           peak_flops=8e10, intra_bw=1e9, intra_latency=2e-4, efficiency=0.9,
                           mem_bw=2e10, comm_overlap=0.0, **more)


def test_every_call_pays_the_overhead_once():
    hw, slow = _cpu(2), _cpu(2, collective_overhead=3e-3)
    # DDP: one allreduce per bucket
    lay = Layout(dp=2, micro_batch=4)
    buckets = 7
    assert comm.dp_collective("ar", 7 * 2**20, lay, slow, buckets) == pytest.approx(
        comm.dp_collective("ar", 7 * 2**20, lay, hw, buckets) + buckets * 3e-3)
    # a pipeline's one-way transfers do not: their sender does not wait
    pp = Layout(pp=2, micro_batch=2)
    assert comm.p2p_stage_time(pp, SPEC, slow, BATCH) == comm.p2p_stage_time(pp, SPEC, hw, BATCH)
    # one process is no collective at all
    assert comm.dp_collective("ar", 1e6, Layout(), slow, 1) == 0.0


def test_tensor_parallel_counts_the_vocabulary_pieces():
    """Per micro-batch: 4 allreduces of b s h per block, one for the vocab-parallel embedding,
    one for the head's input gradient, and the cross-entropy's two of b s values."""
    hw = _cpu(2, collective_overhead=3e-3)
    lay = Layout(tp=2, micro_batch=8)
    bw, alpha = hw.link(2, 1)
    rows = 8 * SPEC.seq_len
    big = comm.allreduce_time(rows * SPEC.hidden * 4, 2, bw, alpha, 1, 3e-3)
    small = (comm.allreduce_time(rows * 4, 2, bw, alpha, 1, 3e-3)
             + comm.allreduce_time(2 * rows * 4, 2, bw, alpha, 1, 3e-3))
    assert comm.tp_time(lay, SPEC, hw, BATCH, SPEC.layers) == pytest.approx(
        (4 * SPEC.layers + 2) * big + small)
    # a pipeline's busiest stage holds one of embedding and head
    assert comm.tp_time(replace(lay, pp=2), SPEC, hw, BATCH, 2) == pytest.approx(
        (4 * 2 + 1) * big + small)


def test_oversubscribed_ranks_absorb_the_bubble():
    """dp 2 x pp 2 on 2 cores: the rate calibrated with 4 ranks computing is the contended
    one; in the bubble half of them idle, so the step is the longer of the critical path at
    twice that rate and each rank's own work at the contended rate. With a device per rank
    (lanes 0) the bubble is (m + pp - 1) slots, as before."""
    lay = Layout(dp=2, pp=2, zero=1, micro_batch=2)
    own = estimate(lay, SPEC, _cpu(4), BATCH)
    shared = estimate(lay, SPEC, _cpu(4, compute_lanes=2), BATCH)
    m = own.microbatches
    assert own.bubble == pytest.approx(1 / (m + 1))
    slot = own.bubble_s                              # 1F1B at pp 2 idles one slot
    t_mb = own.compute_s / m
    free = slot - t_mb + t_mb * 2 / 4
    assert shared.step_s == pytest.approx(own.step_s - (m + 1) * slot + max((m + 1) * free,
                                                                           m * slot))
    assert shared.step_s < own.step_s and shared.bubble_s < own.bubble_s
    # no bubble, nothing to absorb: data parallelism alone is unchanged
    ddp = Layout(dp=4, micro_batch=2)
    assert estimate(ddp, SPEC, _cpu(4, compute_lanes=2), BATCH).step_s == pytest.approx(
        estimate(ddp, SPEC, _cpu(4), BATCH).step_s)


def test_a_calibration_hands_its_overhead_and_lanes_to_the_planner(monkeypatch):
    from shardwise.launch import auto as autoplan
    rank = autoplan.Compute(1, 8e10, 7e10, 0.0, 2e10)
    cal = autoplan.Calibration("cpu", 2, rank, rank, 1e9, 2e-4, 16 * 2**30, 0.0, 3.5e-3)
    monkeypatch.setattr("os.cpu_count", lambda: 2)
    hw = cal.hardware(2)
    assert hw.collective_overhead == 3.5e-3 and hw.compute_lanes == 2
    assert "3.50 ms per call after compute" in cal.describe()


def test_a_copying_backend_costs_an_allreduce_and_its_copies():
    """gloo (collective_copies = 1): ZeRO's reduce-scatter and all-gather take an allreduce's
    time, and the whole-size copies in flight count in the buffers (planner/buffers.py): ZeRO-1
    the whole gradient (every bucket's reduce-scatter waits at the step), ZeRO-2 the buckets
    it is reducing (as large as their staging buffers), ZeRO-3 a gathered unit in flight (at
    most the units held), a pipeline's ZeRO-1 the stage's gradient. NCCL (0) counts none."""
    from shardwise.planner.memory import buffer_parts
    gloo, nccl = _cpu(2, collective_copies=1.0), _cpu(2)
    lay = Layout(dp=2, zero=2, micro_batch=4)
    assert comm.dp_collective("rs", 8e6, lay, gloo, 1) == pytest.approx(
        comm.dp_collective("ar", 8e6, lay, nccl, 1))
    assert comm.dp_collective("rs", 8e6, lay, nccl, 1) < comm.dp_collective("ar", 8e6, lay, nccl, 1)
    p = 1e6
    for zero in (1, 2, 3):
        layout = Layout(dp=2, zero=zero, micro_batch=4)
        parts = buffer_parts(SPEC, layout, BATCH, p, copies=1.0)
        if zero == 1:
            assert parts["backend"] == pytest.approx(4 * p)
        elif zero == 2:
            assert parts["backend"] == pytest.approx(parts["staging"]) and parts["backend"] > 0
        else:
            assert 0 < parts["backend"] <= parts["gathered"]
        assert buffer_parts(SPEC, layout, BATCH, p)["backend"] == 0.0
    piped = buffer_parts(SPEC, Layout(dp=2, pp=2, zero=1, micro_batch=2), BATCH, p, copies=1.0)
    assert piped["backend"] == pytest.approx(4 * p)
    assert buffer_parts(SPEC, Layout(dp=2, micro_batch=4), BATCH, p, copies=1.0)["backend"] == 0
    big = estimate(Layout(dp=2, zero=1, micro_batch=4), SPEC, gloo, BATCH)
    small = estimate(Layout(dp=2, zero=1, micro_batch=4), SPEC, nccl, BATCH)
    # ZeRO-1 at dp 2: the whole fp32 gradient in flight (planner's params ~ the spec's count)
    assert big.memory["buffers"] - small.memory["buffers"] == pytest.approx(4 * SPEC.params,
                                                                            rel=0.05)


def test_a_same_host_allreduce_path_speeds_only_the_allreduce():
    """Hardware.allreduce_bw (CPU ranks on one host sum through shared memory): DDP's allreduce
    and ZeRO's reduce-scatter / all-gather (comm/shm.py serves all three) inside the node move
    at that rate, the latter as half an allreduce, with no gloo copy; tensor parallelism and
    pipeline sends keep the link's; 0 changes nothing."""
    base, shm = _cpu(2, collective_copies=1.0), _cpu(2, collective_copies=1.0, allreduce_bw=4e9)
    ddp = Layout(dp=2, micro_batch=4)
    k = 13e6
    bw, alpha = base.link(2, 1)
    assert comm.dp_collective("ar", k, ddp, shm, 1) == pytest.approx(
        comm.allreduce_time(k, 2, 4e9, alpha, 1))
    assert comm.dp_collective("ar", k, ddp, shm, 1) < comm.dp_collective("ar", k, ddp, base, 1)
    zero = Layout(dp=2, zero=2, micro_batch=4)
    assert comm.dp_collective("rs", k, zero, shm, 1) == pytest.approx(
        comm.reduce_scatter_time(k, 2, 4e9, alpha, 1))
    assert comm.dp_collective("rs", k, zero, base, 1) == pytest.approx(   # gloo: an allreduce
        comm.allreduce_time(k, 2, bw, alpha, 1))
    tp = Layout(tp=2, micro_batch=8)
    assert comm.tp_time(tp, SPEC, shm, BATCH, 4) == comm.tp_time(tp, SPEC, base, BATCH, 4)
    assert estimate(ddp, SPEC, shm, BATCH).step_s < estimate(ddp, SPEC, base, BATCH).step_s
    assert estimate(zero, SPEC, shm, BATCH).step_s < estimate(zero, SPEC, base, BATCH).step_s
    # a group that spans nodes does not take a one-host path
    two_nodes = replace(shm, nodes=2, devices_per_node=1, inter_bw=1e9)
    assert comm.dp_collective("ar", k, ddp, two_nodes, 1) == pytest.approx(
        comm.dp_collective("ar", k, ddp, replace(two_nodes, allreduce_bw=0.0), 1))


def test_a_calibration_hands_the_shared_memory_rate_to_multi_process_hardware():
    from shardwise.launch import auto as autoplan
    rank = autoplan.Compute(1, 8e10, 7e10, 0.0, 2e10)
    cal = autoplan.Calibration("cpu", 2, rank, rank, 1e9, 2e-4, 16 * 2**30, 0.0, 1e-3, 2.5e9)
    assert cal.hardware(2).allreduce_bw == 2.5e9 and cal.hardware(2).intra_bw == 1e9
    assert cal.hardware(1).allreduce_bw == 0.0
    assert "shared memory 2.50 GB/s" in cal.describe()
    assert "shared memory" not in replace(cal, shared_allreduce_bw=0.0).describe()


def test_the_optimizer_step_runs_at_the_measured_rate():
    """Hardware.optimizer_bw (a CPU calibration times the configured optimizer): the step's
    bytes per parameter over that rate, for every layout that steps on the device; 0 keeps the
    memory bandwidth."""
    from shardwise.planner.cost import optimizer_bytes
    fast, slow = _cpu(2), _cpu(2, optimizer_bw=5e9)
    assert optimizer_bytes(BATCH) == 28            # fp32 AdamW: 2x4 weights + 2x8 moments + 4
    for lay in (Layout(dp=2, micro_batch=4), Layout(dp=2, zero=1, micro_batch=4),
                Layout(tp=2, micro_batch=8)):
        a, b = estimate(lay, SPEC, fast, BATCH), estimate(lay, SPEC, slow, BATCH)
        assert b.optimizer_s == pytest.approx(a.optimizer_s * fast.mem_bw / 5e9)
        assert b.step_s - a.step_s == pytest.approx(b.optimizer_s - a.optimizer_s)
    z1 = estimate(Layout(dp=2, zero=1, micro_batch=4), SPEC, slow, BATCH)
    ddp = estimate(Layout(dp=2, micro_batch=4), SPEC, slow, BATCH)
    assert z1.optimizer_s == pytest.approx(ddp.optimizer_s / 2)   # each rank steps its half


def test_on_a_cpu_an_offloaded_step_is_no_faster_than_the_device_step():
    """On a CPU the host is the device: a calibration gives the offloaded optimizer step the
    measured optimizer rate too, so offloading can only add copies (before, a slow measured
    optimizer made offload=cpu look faster than stepping in place)."""
    from shardwise.launch import auto as autoplan
    rank = autoplan.Compute(1, 8e10, 7e10, 0.0, 2e10, optimizer_bw=1e9)
    hw = autoplan.Calibration("cpu", 1, rank, rank, 0.0, 0.0, 16 * 2**30, 0.0).hardware(1)
    assert hw.optimizer_bw == hw.host_mem_bw == 1e9
    batch = Batch(8, precision="fp32")
    here = estimate(Layout(zero=1, micro_batch=8), SPEC, hw, batch)
    off = estimate(Layout(zero=1, offload="cpu", micro_batch=8), SPEC, hw, batch)
    assert off.step_s > here.step_s
