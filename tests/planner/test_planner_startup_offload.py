"""Meta-device init's start-up (no whole-model peak), parameter offload's disk I/O, and the
plan's line when a model fits only with disk offload."""
import pytest

from shardwise.planner import Batch, Hardware, Layout, PRESETS, estimate, plan
from shardwise.planner.cli import main
from shardwise.planner.model import parse_model
from shardwise.planner.offload import disk_bytes_per_step

SEVEN_B = PRESETS["7B"]


def test_meta_init_builds_only_the_ranks_part_eager_the_whole_model():
    hw = Hardware.from_catalogue("a100-80gb", devices_per_node=8)
    lay = Layout(dp=8, zero=3)
    meta = estimate(lay, SEVEN_B, hw, Batch(64))
    eager = estimate(lay, SEVEN_B, hw, Batch(64, init="eager"))
    assert meta.startup == pytest.approx(4 * SEVEN_B.params / 8)      # its fp32 shard
    assert meta.startup_host_per_node == 0
    assert eager.startup == pytest.approx(4 * SEVEN_B.params)          # the whole fp32 model
    assert eager.startup_host_per_node == pytest.approx(8 * 4 * SEVEN_B.params)
    # a host that holds the run but not 8 whole fp32 models: eager does not fit, meta does
    small = Hardware.from_catalogue("a100-80gb", devices_per_node=8,
                                    host_memory_bytes=int(4 * 4 * SEVEN_B.params))
    assert estimate(lay, SEVEN_B, small, Batch(64)).fits
    refused = estimate(lay, SEVEN_B, small, Batch(64, init="eager"))
    assert not refused.fits and refused.why_not.startswith("start-up: --init eager")


def test_disk_io_per_step_follows_the_runtime_store():
    """ZeRO-3 with everything on disk, one micro-batch: 3 reads and a write of the 16-bit
    parameter shard, 2 moves of the fp32 gradient shard, a read and a write of master and
    optimizer states (shardwise/parallel/data/zero_stage3.py's docstring)."""
    lay = Layout(dp=8, zero=3, offload="disk", offload_params="disk")
    owned = 1e9
    expect = (3 + 1) * 2 * owned + 2 * 4 * owned + 2 * (4 + 8) * owned
    assert disk_bytes_per_step(lay, Batch(8), owned, 1) == pytest.approx(expect)
    # 7B's disk state (18 B a parameter, 126 GB) against a 256 GiB host: more than a quarter
    # of it, so --offload-sync auto syncs and the step waits for the disk
    hw = Hardware.from_catalogue("a100-80gb", devices_per_node=8, disk_bw=2e9,
                                 host_memory_bytes=256 * 2**30)
    e = estimate(lay, SEVEN_B, hw, Batch(8))
    per_rank = disk_bytes_per_step(lay, Batch(8), SEVEN_B.params / 8, e.microbatches)
    assert e.disk_io_per_node == pytest.approx(8 * per_rank)
    assert e.disk_per_node > hw.host_memory_bytes / 4
    assert e.offload_s >= e.disk_io_per_node / hw.disk_bw


def test_a_disk_state_the_page_cache_holds_is_charged_at_memory_speed():
    """The same layout on a 1 TiB host: the disk state is under a quarter of the memory, so
    the runtime's --offload-sync auto leaves the writes to the kernel and the page cache
    serves the reads; the planner charges the I/O at host memory bandwidth, not the disk's
    (offload.disk_rate), and a smaller disk state is never charged more than a larger one."""
    lay = Layout(dp=8, zero=3, offload="disk", offload_params="disk")
    big = Hardware.from_catalogue("a100-80gb", devices_per_node=8, disk_bw=2e9,
                                  host_memory_bytes=1024 * 2**30)
    small = Hardware.from_catalogue("a100-80gb", devices_per_node=8, disk_bw=2e9,
                                    host_memory_bytes=256 * 2**30)
    cached, synced = estimate(lay, SEVEN_B, big, Batch(8)), estimate(lay, SEVEN_B, small, Batch(8))
    assert cached.disk_per_node <= big.host_memory_bytes / 4
    assert cached.offload_s < cached.disk_io_per_node / big.disk_bw
    assert cached.offload_s >= cached.disk_io_per_node / big.host_mem_bw
    assert cached.offload_s < synced.offload_s


def _one_gpu(host: str) -> Hardware:
    from shardwise.planner.units import parse_bytes
    return Hardware.from_catalogue("a100-80gb", devices_per_node=1,
                                   host_memory_bytes=parse_bytes(host, "host-memory"))


def test_a_model_larger_than_ram_fits_only_with_disk_and_the_plan_says_so():
    """13B's 16 bytes per parameter (192 GiB) exceed a 64 GiB host but not the disk: every
    fitting layout offloads to disk, and the plan says so with the I/O per step."""
    hw = _one_gpu("64GiB")
    result = plan(parse_model("13B"), hw, Batch(8), everything=True)
    w = result.winner
    assert all("disk" in (e.layout.offload, e.layout.offload_params) for e in result.ranked)
    state = w.disk_per_node + w.host_per_node
    assert state > hw.host_memory_bytes
    note = result.disk_note
    assert note.startswith("Fits only with --offload disk") and "vs 64.00 GiB RAM" in note
    assert f"at {hw.disk_bw / 1e9:.3g} GB/s" in note


def test_a_model_that_fits_in_ram_gets_no_disk_line():
    """A 1.3B model's states (16 bytes per parameter, 20 GiB) fit the same 64 GiB host: cpu
    offload or none, and no line."""
    result = plan(parse_model("24,2048,16,2048,50257"), _one_gpu("64GiB"), Batch(8),
                  everything=True)
    model = parse_model("24,2048,16,2048,50257")
    assert 16 * model.params < 64 * 2**30
    assert result.winner is not None and result.disk_note == ""
    assert "disk" not in (result.winner.layout.offload, result.winner.layout.offload_params)


def test_cli_prints_the_disk_line_and_the_start_up(capsys):
    argv = ["--model", "13B", "--gpus-per-node", "1", "--host-memory", "64GiB",
            "--global-batch", "8", "--disk-bw", "3GB/s"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Fits only with --offload disk" in out and "at 3 GB/s" in out
    assert "Start-up (--init meta): each rank builds only what it keeps" in out
    assert main(argv + ["--init", "eager"]) == 0
    assert "Start-up (--init eager): the whole fp32 model" in capsys.readouterr().out
