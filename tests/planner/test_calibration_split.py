"""The CPU calibration's split of the GPT's time (launch/calibrate.activation_passes): GEMMs at
the matmul rate, the rest as passes over the activation bytes. The planner must give back the
calibrated model's own fitted time at every micro-batch (the split changes nothing there), and
charge a wider model's blocks nearer the matmul rate than the whole-block rate would."""
import pytest

from shardwise.launch.calibrate import activation_passes
from shardwise.planner import Batch, Hardware, Layout, ModelSpec
from shardwise.planner.compute import microbatch_seconds

BENCH = ModelSpec(4, 256, 4, 128, 256, tied_embeddings=False, fused_attention=True)
WIDE = ModelSpec(8, 768, 12, 128, 256, tied_embeddings=False, fused_attention=True)
MATMUL, MEM_BW, C0 = 90e9, 30e9, 4e-3       # a CPU's matmul rate and copy bandwidth
FP32 = Batch(8, precision="fp32")


def _hw(**fields) -> Hardware:
    return Hardware.custom(nodes=1, devices_per_node=1, memory_bytes=16 * 2**30,
                           peak_flops=MATMUL, intra_bw=1e12, mem_bw=MEM_BW,
                           block_overhead=C0 / BENCH.layers, **fields)


@pytest.mark.parametrize("model_rate", [50e9, 75e9])
def test_the_split_gives_back_the_calibrated_time_and_charges_wide_gemms_less(model_rate):
    per_row = BENCH.flops_per_token() * BENCH.seq_len / model_rate     # the fit's slope
    passes = activation_passes(BENCH, FP32, per_row, MATMUL, MEM_BW)
    assert passes > 0
    split = _hw(activation_passes=passes)
    whole = _hw(efficiency=model_rate / MATMUL)                         # the old whole-block rate
    for b in (1, 2, 8):
        assert microbatch_seconds(Layout(micro_batch=b), BENCH, split, FP32) == \
            pytest.approx(b * per_row + C0, rel=1e-9)
        assert microbatch_seconds(Layout(micro_batch=b), BENCH, whole, FP32) == \
            pytest.approx(b * per_row + C0, rel=1e-9)
    # the wider model: more GEMM FLOPs per activation byte, so faster per FLOP than the
    # narrow blocks' whole-block rate, and never faster than the matmul rate
    wide = microbatch_seconds(Layout(micro_batch=4), WIDE, split, FP32)
    assert wide < microbatch_seconds(Layout(micro_batch=4), WIDE, whole, FP32)
    assert wide > 4 * WIDE.flops_per_token() * WIDE.seq_len / MATMUL


def test_a_gpt_faster_than_the_matmul_keeps_the_whole_block_rate():
    per_row = 0.95 * BENCH.flops_per_token() * BENCH.seq_len / MATMUL
    assert activation_passes(BENCH, FP32, per_row, MATMUL, MEM_BW) == 0.0
