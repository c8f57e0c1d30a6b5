"""Memory model: ZeRO's bytes-per-parameter formulas and Korthikanti's activation formula.

Every expected value is written as the paper writes it (P parameters, N = dp), never as a
number copied from the code's output.
"""
import pytest

from shardwise.planner import Batch, Hardware, Layout, estimate
from shardwise.planner.memory import (activation_per_layer, memory, model_states, stage_params,
                                      state_bytes)
from shardwise.planner.model import PRESETS, ModelSpec

MODEL_STATES = ("parameters", "gradients", "optimizer_states", "master_weights")


def zero_mixed_adam(p: float, n: int) -> dict[int, float]:
    """ZeRO paper, Figure 1 / section 5: 2 + 2 + K bytes per parameter, K = 12."""
    return {0: 16 * p, 1: 4 * p + 12 * p / n, 2: 2 * p + 14 * p / n, 3: 16 * p / n}


def zero_fp32_adam(p: float, n: int) -> dict[int, float]:
    """fp32 weights 4, gradients 4, Adam moments 8, no master copy."""
    return {0: 16 * p, 1: 8 * p + 8 * p / n, 2: 4 * p + 12 * p / n, 3: 16 * p / n}


@pytest.mark.parametrize("n", [1, 2, 8, 64])
@pytest.mark.parametrize("precision, formula", [
    ("bf16", zero_mixed_adam), ("fp16", zero_mixed_adam), ("fp32", zero_fp32_adam)])
def test_model_states_reproduce_the_zero_paper(n, precision, formula):
    p = 7.5e9  # the paper's running example: 7.5B parameters
    for stage, expected in formula(p, n).items():
        states, offloaded = model_states(p, Layout(dp=n, zero=stage), Batch(n, precision))
        assert sum(states.values()) == pytest.approx(expected)
        assert offloaded == 0


def test_zero_paper_example_7_5b_on_64_gpus():
    """The paper's own numbers: 120 GB, 31.4 GB, 16.6 GB, 1.88 GB (P = 7.5B, N = 64)."""
    p, n = 7.5e9, 64
    got = [sum(model_states(p, Layout(dp=n, zero=z), Batch(n))[0].values()) / 1e9
           for z in range(4)]
    # The paper prints three significant figures (16.64 -> 16.6): tolerance 0.5% of that.
    assert got == pytest.approx([120, 31.4, 16.6, 1.88], rel=5e-3)


def test_estimate_memory_uses_the_same_formulas():
    """Through ``estimate``: the model-state categories of a whole-model replica are ZeRO's."""
    model = PRESETS["7B"]
    hw = Hardware.from_catalogue("a100-80gb", nodes=1, devices_per_node=8)
    for stage, expected in zero_mixed_adam(model.params, 8).items():
        e = estimate(Layout(dp=8, zero=stage), model, hw, Batch(64))
        assert sum(e.memory[k] for k in MODEL_STATES) == pytest.approx(expected)


def test_sgd_keeps_one_moment():
    states, _ = model_states(1e9, Layout(), Batch(1, "bf16", "sgd"))
    assert states["optimizer_states"] == 4 * 1e9
    assert state_bytes(Batch(1, "fp32", "adam"))["master_weights"] == 0


def test_offload_moves_master_and_optimizer_off_the_device():
    p, n = 1e9, 4
    device, host = model_states(p, Layout(dp=n, zero=2, offload="cpu"), Batch(n))
    assert device == {"parameters": 2 * p, "gradients": 0, "master_weights": 0,
                      "optimizer_states": 0}
    assert host == pytest.approx((4 + 8 + 4) * p / n)  # master, moments, fp32 gradients
    device3, host3 = model_states(p, Layout(dp=n, zero=3, offload="disk"), Batch(n))
    assert sum(device3.values()) == 0 and host3 == pytest.approx((4 + 8 + 4 + 2) * p / n)


def test_activations_match_korthikanti_eq_2():
    """s b h (34 + 5 a s / h) bytes per layer without tp; (10 + 24/t) with tp; 34/t with sp."""
    m = PRESETS["175B"]
    s, h, a, b = m.seq_len, m.hidden, m.heads, 2
    one = activation_per_layer(m, Layout(micro_batch=b), Batch(1), full=True)
    assert one == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    t = 8
    tp = activation_per_layer(m, Layout(tp=t, micro_batch=b), Batch(1), full=True)
    assert tp == pytest.approx(s * b * h * (10 + 24 / t + 5 * a * s / (h * t)))
    sp = activation_per_layer(m, Layout(tp=t, micro_batch=b, sequence_parallel=True), Batch(1),
                              full=True)
    assert sp == pytest.approx(s * b * h * (34 / t + 5 * a * s / (h * t)))
    ckpt = activation_per_layer(m, Layout(micro_batch=b), Batch(1), full=False)
    assert ckpt == 2 * s * b * h


def test_pipeline_in_flight_micro_batches():
    """1F1B's first stage holds pp micro-batches, GPipe's holds all m: the ratio is m / pp."""
    m = ModelSpec(8, 256, 4, 128, 256)
    hw = Hardware.custom(nodes=1, devices_per_node=4, memory_bytes=2**40, peak_flops=1e12,
                         intra_bw=1e9)
    batch = Batch(32)
    one_f = memory(Layout(pp=4, schedule="1f1b"), m, hw, batch)
    gpipe = memory(Layout(pp=4, schedule="gpipe"), m, hw, batch)
    logits = 4 * m.seq_len * m.vocab  # only on the last stage, not the one compared here
    assert one_f.role == gpipe.role == "stage 0"
    assert gpipe.device["activations"] / one_f.device["activations"] == pytest.approx(32 / 4)
    assert logits > 0


def test_parameter_count_and_stage_split():
    m = PRESETS["175B"]
    h, L = m.hidden, m.layers
    assert m.layer_params == 12 * h * h + 13 * h
    assert m.params == L * (12 * h * h + 13 * h) + (m.vocab + m.seq_len) * h + 2 * h
    # Stages hold every parameter once, plus the tied head's copy on the last stage.
    assert sum(stage_params(m, 16, s) for s in range(16)) == m.params + m.vocab * h
    tiny = PRESETS["gpt-tiny"]  # shardwise's own GPT: untied head
    assert tiny.params == 4 * tiny.layer_params + (256 + 128) * 128 + 2 * 128 + 256 * 128
