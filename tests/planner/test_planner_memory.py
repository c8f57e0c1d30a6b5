"""Memory model: ZeRO's bytes-per-parameter formulas and Korthikanti's activation formula.

Every expected value is written as the paper writes it (P parameters, N = dp), never as a
number copied from the code's output.
"""
import pytest

from shardwise.planner import Batch, Hardware, Layout, PlanError, estimate
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
        assert offloaded == {"cpu": 0.0, "disk": 0.0}


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
    device, moved = model_states(p, Layout(dp=n, zero=2, offload="cpu"), Batch(n))
    assert device == {"parameters": 2 * p, "gradients": 0, "master_weights": 0,
                      "optimizer_states": 0}
    assert moved == {"cpu": pytest.approx((4 + 8 + 4) * p / n), "disk": 0.0}  # + fp32 grads
    # ZeRO-1 keeps its whole 16-bit gradients on the device.
    device1, _ = model_states(p, Layout(dp=n, zero=1, offload="disk"), Batch(n))
    assert device1["gradients"] == 2 * p and device1["optimizer_states"] == 0


def test_every_zero3_offload_combination():
    """ZeRO-3 with only the optimizer offloaded keeps the 2P/N parameter partition; with the
    parameters offloaded too nothing stays; the two may go to different places."""
    p, n = 1e9, 4
    opt_only, moved = model_states(p, Layout(dp=n, zero=3, offload="cpu"), Batch(n))
    assert sum(opt_only.values()) == pytest.approx(2 * p / n) == opt_only["parameters"]
    assert moved["cpu"] == pytest.approx(16 * p / n)
    both, moved = model_states(p, Layout(dp=n, zero=3, offload="disk", offload_params="disk"),
                               Batch(n))
    assert sum(both.values()) == 0 and moved["disk"] == pytest.approx((16 + 2) * p / n)
    split, moved = model_states(p, Layout(dp=n, zero=3, offload="disk", offload_params="cpu"),
                                Batch(n))
    assert moved == {"cpu": pytest.approx(2 * p / n), "disk": pytest.approx(16 * p / n)}
    params_only, moved = model_states(p, Layout(dp=n, zero=3, offload_params="cpu"), Batch(n))
    assert params_only["parameters"] == 0 and moved["cpu"] == pytest.approx(2 * p / n)
    assert sum(params_only.values()) == pytest.approx(14 * p / n)
    hw = Hardware.from_catalogue("a100-80gb", devices_per_node=4)
    e = estimate(Layout(dp=n, zero=3, offload="disk", offload_params="cpu"), PRESETS["7B"], hw,
                 Batch(n))
    assert e.host_per_node > 0 and e.disk_per_node > 0 and e.offload_s > 0


def test_deepspeed_convention_counts_the_fp32_gradient_partition():
    """DeepSpeed's estimate_zero2_model_states_mem_needs: 4P + 16P/N without offload, 2P with
    cpu offload; estimate_zero3_model_states_mem_needs: 18P/N (+ the largest layer, buffers);
    DDP stays 16P. The ZeRO paper's convention: 2P + 14P/N and 16P/N."""
    p, n = 7.5e9, 64
    ds = Batch(n, convention="deepspeed")
    total = {z: sum(model_states(p, Layout(dp=n, zero=z), ds)[0].values()) for z in range(4)}
    assert total[0] == pytest.approx(16 * p)
    assert total[1] == total[2] == pytest.approx(4 * p + 16 * p / n)
    assert total[3] == pytest.approx(18 * p / n)
    off = model_states(p, Layout(dp=n, zero=2, offload="cpu"), ds)[0]
    assert sum(off.values()) == pytest.approx(2 * p)
    z3_opt = model_states(p, Layout(dp=n, zero=3, offload="cpu"), ds)[0]
    assert sum(z3_opt.values()) == pytest.approx(2 * p / n)
    paper = sum(model_states(p, Layout(dp=n, zero=2), Batch(n))[0].values())
    assert paper == pytest.approx(2 * p + 14 * p / n)
    with pytest.raises(PlanError, match="--convention: "):
        Batch(n, convention="megatron")


def test_selective_recompute_drops_only_the_attention_core():
    """Korthikanti et al. 2022, section 5: selective recomputation keeps s b h (10 + 24/t)
    (34/t with sp) per layer and recomputes the 5 a s^2 b / t of attention; its extra forward
    FLOPs are the attention core's, 4 s h per token and layer."""
    m = PRESETS["175B"]
    s, h, t, b = m.seq_len, m.hidden, 8, 1
    lay = Layout(tp=t, micro_batch=b, sequence_parallel=True, selective_recompute=True)
    assert activation_per_layer(m, lay, Batch(1), full=True) == pytest.approx(s * b * h * 34 / t)
    assert m.block_flops("selective") - m.block_flops() == pytest.approx(4 * s * h)
    assert lay.recompute == "selective" and "recompute=selective" in lay.describe()
    with pytest.raises(PlanError, match="--selective-recompute: "):
        Layout(act_ckpt=True, selective_recompute=True)


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
