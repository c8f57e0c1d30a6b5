"""The planner's peak-instant memory and its fused-attention flag (shardwise/planner/memory.py).

Expected values are computed from the module docstring's formulas here, never typed in: a GPT
of 8 layers x 768 (the size of shardwise/bench/validate_planner_memory.py), fp32 Adam.
"""
from dataclasses import replace

import pytest

from shardwise.planner import Batch, Hardware, Layout, ModelSpec
from shardwise.planner.memory import memory

SPEC = ModelSpec(8, 768, 12, 128, 256, tied_embeddings=False)
FUSED = replace(SPEC, fused_attention=True)
HW = Hardware(nodes=1, devices_per_node=8, memory_bytes=80 * 2**30, peak_flops=1e14,
              intra_bw=1e11, inter_bw=1e10)
FP32 = Batch(4, precision="fp32")


def _mem(layout, spec=FUSED, batch=FP32):
    return memory(layout, spec, HW, batch)


def test_fused_attention_drops_the_score_matrices():
    lay = Layout(dp=2, micro_batch=2)
    s, b, a, L = SPEC.seq_len, lay.micro_batch, SPEC.heads, SPEC.layers
    scores = 2 * 5 * a * s * s * b * L          # fp32 doubles Korthikanti's 5 a s^2 b
    plain, fused = _mem(lay, SPEC).device, _mem(lay).device
    assert plain["activations"] - fused["activations"] == pytest.approx(scores)
    # selective recomputation drops the same term: the two agree when both hold
    sel = memory(replace(lay, selective_recompute=True), SPEC, HW, FP32).device
    assert sel["activations"] == pytest.approx(fused["activations"])


def test_peak_is_at_most_the_sum_and_equal_without_transients():
    for lay in (Layout(dp=2, micro_batch=2), Layout(dp=2, zero=3, micro_batch=2),
                Layout(pp=2, micro_batch=2), Layout(dp=2, num_ps=1, micro_batch=2)):
        m = _mem(lay)
        assert m.peak <= m.total + 1e-6
    server = _mem(Layout(dp=2, num_ps=1, micro_batch=2))
    assert server.role == "server" and server.peak == pytest.approx(server.total)


def test_zero3_peak_takes_the_larger_phase():
    m = _mem(Layout(dp=2, zero=3, micro_batch=2))
    d = m.device
    gathered = 2 * 4 * FUSED.layer_params                    # two fp32 blocks
    buckets = d["buffers"] - gathered
    persistent = d["parameters"] + d["optimizer_states"]      # gradients are the shard: transient
    forward = d["activations"] + gathered
    backward = d["gradients"] + buckets + gathered
    assert m.peak == pytest.approx(persistent + max(forward, backward))
    assert m.peak < m.total


def test_ddp_keeps_gradients_through_forward():
    d = (m := _mem(Layout(dp=2, micro_batch=2))).device
    states = d["parameters"] + d["gradients"] + d["optimizer_states"]
    assert m.peak == pytest.approx(states + max(d["activations"], d["buffers"]))


def test_single_device_frees_gradients_at_zero_grad():
    d = (m := _mem(Layout(micro_batch=4))).device
    assert m.peak == pytest.approx(d["parameters"] + d["optimizer_states"]
                                   + max(d["activations"], d["gradients"]))
    # several micro-batches per step: the gradients accumulate through the next forward
    acc = _mem(Layout(micro_batch=2))
    assert acc.peak == pytest.approx(sum(v for k, v in acc.device.items() if k != "buffers"))


def test_zero2_accumulation_keeps_the_shard():
    one, acc = _mem(Layout(dp=2, zero=2, micro_batch=2)), _mem(Layout(dp=2, zero=2, micro_batch=1))
    d = acc.device
    persistent = d["parameters"] + d["gradients"] + d["optimizer_states"]
    assert acc.peak == pytest.approx(persistent + max(d["activations"], d["buffers"]))
    assert one.peak < one.total


def test_server_buffers_one_message_per_worker_each_way():
    lay = Layout(dp=3, num_ps=1, micro_batch=1)
    d = _mem(lay).device
    assert d["buffers"] == pytest.approx(4 * FUSED.params * (2 * lay.dp + 1))
