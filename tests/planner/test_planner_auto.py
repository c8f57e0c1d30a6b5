"""``shardwise train --strategy auto``: calibration, the layout -> config conversion, the choice
among runnable layouts, and an end-to-end run through the CLI."""
import os
import platform
import subprocess
import sys
from dataclasses import replace

import pytest

from reference import tiny_config
from shardwise.launch import auto as autoplan
from shardwise.launch import torchrun as launch
from shardwise.cli import parse_config
from shardwise.models import build_model
from shardwise.planner import Layout
from shardwise.planner.layout import KINDS
from shardwise.run.validate import validate

pytestmark = pytest.mark.timeout(300)


def _auto_cfg(batch: int = 8):
    cfg = tiny_config("auto", steps=3)
    return replace(cfg, train=replace(cfg.train, batch_size=batch))


def test_calibration_measures_positive_figures():
    cal = autoplan.calibrate(_auto_cfg())
    assert cal.processes == launch.local_world_size(replace(_auto_cfg(), parallel=replace(
        _auto_cfg().parallel, strategy="ddp")))
    for c in (cal.per_rank, cal.whole):
        assert c.threads >= 1
        assert c.matmul_flops > 0 and c.model_flops > 0 and c.mem_bw > 0
        assert c.block_overhead >= 0
    assert cal.allreduce_bw > 0 and cal.allreduce_latency > 0    # a real 2-process gloo world
    assert cal.memory_bytes > 0
    for n in (1, cal.processes):
        hw = cal.hardware(n)
        assert hw.devices_per_node == n and 0 < hw.efficiency <= 1
        assert hw.memory_bytes <= cal.memory_bytes
    assert "allreduce over" in cal.describe()
    # the offload directory's disk, read and written, sets the planner's disk figures
    assert cal.disk is not None and cal.disk.read_bw > 0 and cal.disk.write_bw > 0
    assert cal.hardware(1).disk_bw == cal.disk.bandwidth and "disk (" in cal.describe()
    # DDP's allreduce: shared memory on one x86 host whose ranks poll (ranks x threads <= cores:
    # this machine's 2 ranks of 1 thread), timed through the reducer training uses; gloo's
    # elsewhere
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    polls = cal.processes * cal.per_rank.threads <= len(os.sched_getaffinity(0))
    if x86 and polls and cal.processes > 1:
        assert cal.shared_allreduce_bw > 0
        assert cal.hardware(cal.processes).allreduce_bw == cal.shared_allreduce_bw
    else:
        assert cal.shared_allreduce_bw == 0.0


def test_calibration_without_the_shared_memory_path_times_gloo_only():
    cfg = _auto_cfg()
    cfg = replace(cfg, parallel=replace(cfg.parallel, allreduce="native"))
    cal = autoplan.calibrate(cfg)
    assert cal.shared_allreduce_bw == 0.0 and cal.allreduce_bw > 0
    assert cal.hardware(cal.processes).allreduce_bw == 0.0


def test_model_spec_counts_the_real_gpt():
    cfg = _auto_cfg()
    real = sum(p.numel() for p in build_model(cfg.model, 0).parameters())
    # the planner's per-block count (4h^2 + 2hf + 9h + f) includes a qkv bias of 3h that
    # shardwise's GPT leaves out (as GPT-NeoX / Llama do): exactly that much more, no other gap
    m = cfg.model
    assert autoplan.model_spec(cfg).params - real == 3 * m.n_embd * m.n_layer


# (layout, world, expected config fields) for each kind the planner names
CASES = [
    (Layout(micro_batch=8), 1, {"strategy": "single", "grad_accum": 1}),
    (Layout(micro_batch=2), 1, {"strategy": "single", "grad_accum": 4}),
    (Layout(dp=2, micro_batch=4), 2, {"strategy": "ddp", "dp": 2, "grad_accum": 1}),
    (Layout(dp=2, zero=1, micro_batch=2), 2, {"strategy": "zero1", "dp": 2, "grad_accum": 2}),
    (Layout(dp=2, zero=2, offload="cpu", micro_batch=4), 2,
     {"strategy": "zero2", "dp": 2, "offload": "cpu"}),
    (Layout(dp=2, zero=3, act_ckpt=True, micro_batch=4), 2,
     {"strategy": "zero3", "activation_checkpointing": True}),
    (Layout(tp=2, micro_batch=8), 2, {"strategy": "tp", "tp": 2, "dp": 1, "pp": 1}),
    (Layout(pp=2, micro_batch=2, schedule="gpipe"), 2,
     {"strategy": "pp", "pp": 2, "num_microbatches": 4, "schedule": "gpipe", "grad_accum": 1}),
    (Layout(dp=2, pp=2, zero=1, micro_batch=2), 4,
     {"strategy": "3d", "dp": 2, "pp": 2, "zero1_over_dp": True, "num_microbatches": 2}),
    (Layout(dp=2, num_ps=1, micro_batch=4), 3,
     {"strategy": "ps", "num_ps": 1, "num_workers": 2}),
    (Layout(dp=4, zero=3, dp_replicate=2, micro_batch=2), 4,
     {"strategy": "zero3", "dp": 4, "dp_replicate": 2, "dp_shard": 2}),
    (Layout(dp=2, zero=3, offload="cpu", offload_params="cpu", micro_batch=4), 2,
     {"strategy": "zero3", "offload": "cpu", "offload_params": True, "dp_shard": 0}),
    (Layout(cp=2, micro_batch=8), 2, {"strategy": "ddp", "dp": 1, "cp": 2, "cp_impl": "ring"}),
    (Layout(dp=2, cp=2, zero=3, cp_impl="ulysses", micro_batch=4), 4,
     {"strategy": "zero3", "dp": 2, "cp": 2, "cp_impl": "ulysses"}),
]


@pytest.mark.parametrize("layout,world,expect", CASES, ids=[c[0].describe() for c in CASES])
def test_layout_to_config(layout, world, expect):
    cfg = _auto_cfg()
    new, changes = autoplan.to_config(layout, cfg)
    fields = {**vars(new.parallel), **vars(new.memory)}
    for key, value in expect.items():
        assert fields[key] == value, key
    # the converted config starts exactly layout.world processes and passes validation
    assert launch.local_world_size(new) == world == layout.world
    validate(new, world)
    # the flags appended to argv reproduce it (the torchrun relaunch parses them)
    reparsed, _ = parse_config(["--strategy", "auto", *autoplan.flags(changes)])
    for key, value in changes.items():
        sec, name = key.split(".")
        assert getattr(getattr(reparsed, sec), name) == value, key


def test_disk_measurement_is_bounded_and_feeds_the_planner(tmp_path):
    from shardwise.launch.calibrate import measure_disk
    disk = measure_disk(str(tmp_path), size=4 << 20, budget=1.0)
    assert disk.size == 4 << 20 and disk.read_bw > 0 and disk.write_bw > 0
    assert min(disk.read_bw, disk.write_bw) <= disk.bandwidth <= max(disk.read_bw,
                                                                     disk.write_bw)
    assert disk.hardware_fields()["disk_bytes"] == disk.free_bytes
    assert not list(tmp_path.iterdir())                   # the test file is gone
    assert measure_disk(str(tmp_path / "missing")) is None


def test_parameters_offloaded_elsewhere_and_sp_without_the_field_are_not_runnable():
    cfg = _auto_cfg()
    split = Layout(dp=2, zero=3, offload="cpu", offload_params="disk")
    assert "--offload-params" in autoplan.why_not_runnable(split, cfg)
    if not hasattr(cfg.parallel, "sequence_parallel"):   # until --sp lands
        sp = Layout(tp=2, sequence_parallel=True)
        assert "not in this installation" in autoplan.why_not_runnable(sp, cfg)


def test_an_interleaved_layout_runs_its_virtual_stages_or_is_not_runnable():
    layout = Layout(pp=2, micro_batch=2, schedule="interleaved-1f1b", virtual_stages=2)
    cfg = _auto_cfg()                                     # 2 layers: 4 chunks do not fit
    assert "parallel.virtual_stages = 2" in autoplan.why_not_runnable(layout, cfg)
    deeper = replace(cfg, model=replace(cfg.model, n_layer=4))
    new, changes = autoplan.to_config(layout, deeper)
    assert (new.parallel.schedule, new.parallel.virtual_stages) == ("interleaved-1f1b", 2)
    assert changes["parallel.virtual_stages"] == 2 and not autoplan.why_not_runnable(layout, deeper)


def _fake_calibration(allreduce_bw: float, whole_speedup: float) -> autoplan.Calibration:
    """A machine given by numbers: 2 processes, 50 GFLOP/s per rank, no block overhead."""
    rank = autoplan.Compute(threads=1, matmul_flops=50e9, model_flops=40e9, block_overhead=0.0,
                            mem_bw=10e9)
    whole = replace(rank, threads=2, matmul_flops=50e9 * whole_speedup,
                    model_flops=40e9 * whole_speedup)
    return autoplan.Calibration("cpu", 2, rank, whole, allreduce_bw, 50e-6, 16 * 2**30, 0.0)


def test_choice_follows_the_measured_machine():
    cfg = replace(_auto_cfg(16), model=replace(_auto_cfg().model, n_layer=4, n_embd=128))
    quiet = lambda *_: None  # noqa: E731
    # a fast link and no gain from a second thread: two processes beat one
    fast = autoplan.choose(cfg, _fake_calibration(10e9, 1.0), say=quiet)
    assert fast.config.parallel.strategy in ("ddp", "zero1", "zero2", "zero3", "tp", "pp", "ps")
    assert fast.estimate.step_s < fast.alternatives[1].step_s
    # a crawling link and a second thread that doubles one process: one process wins
    slow = autoplan.choose(cfg, _fake_calibration(1e6, 2.0), say=quiet)
    assert slow.config.parallel.strategy == "single" and slow.flags[:2] == ["--strategy", "single"]
    assert slow.estimate.step_s < slow.alternatives[2].step_s


def test_choice_skips_strategies_not_installed(monkeypatch):
    import shardwise.parallel as par
    cfg = _auto_cfg(16)
    # sequence parallelism is installed (parallel/sequence.py): runnable under tp, and auto
    # never proposes it with a pipeline, which the runtime refuses
    assert autoplan.why_not_runnable(Layout(tp=2, sequence_parallel=True), cfg) == ""
    assert "--pp" in autoplan.why_not_runnable(Layout(tp=2, pp=2, sequence_parallel=True), cfg)
    assert "micro-batch" in autoplan.why_not_runnable(Layout(dp=2, micro_batch=3), cfg)
    monkeypatch.setattr(par, "available", lambda: ["single", "ddp"])
    choice = autoplan.choose(cfg, _fake_calibration(10e9, 1.0), say=lambda *_: None)
    assert choice.config.parallel.strategy == "ddp"
    assert autoplan.why_not_runnable(Layout(dp=2, zero=3), cfg).startswith("strategy zero3")


def test_auto_under_a_launcher_is_refused(monkeypatch, capsys):
    from shardwise.cli import main
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(["train", "--strategy", "auto", "--steps", "1"]) == 2
    assert "without torchrun" in capsys.readouterr().err


def test_cli_train_auto_end_to_end(tmp_path):
    argv = [sys.executable, "-m", "shardwise.cli", "train", "--strategy", "auto", "--steps", "3",
            "--n-layer", "2", "--n-embd", "32", "--n-head", "2", "--block-size", "32",
            "--batch-size", "8", "--dataset", "synthetic", "--eval-every", "0",
            "--eval-batches", "1", "--device", "cpu", "--out-dir", str(tmp_path),
            "--no-progress"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    chosen = out.split("auto: running ")[1].split()[0]       # e.g. zero3, ddp, single
    assert chosen in KINDS
    assert "auto: calibrated in" in out and "Strategy guide: " in out
    assert f"shardwise {chosen}" in out                      # the run's own summary header
    assert any(name.startswith(chosen) for name in os.listdir(tmp_path))


def test_choice_keeps_what_the_person_set():
    """A --tp / --grad-accum / --offload the person gave rules out every layout that would change
    it; the chosen one keeps them, and a setting no layout can keep is refused in one line."""
    from shardwise.config import ConfigError
    cfg = replace(_auto_cfg(16), model=replace(_auto_cfg().model, n_layer=4, n_embd=128))
    said = []
    free = autoplan.choose(cfg, _fake_calibration(1e6, 2.0), say=lambda *_: None)
    assert free.config.parallel.strategy == "single"        # what auto picks when free
    fixed = {"parallel.tp": 2}
    kept = autoplan.choose(cfg, _fake_calibration(1e6, 2.0), say=said.append, fixed=fixed)
    assert kept.config.parallel.tp == 2 and kept.estimate.layout.tp == 2
    assert any("keeping what you set: --tp 2" in line for line in said)
    both = autoplan.choose(cfg, _fake_calibration(10e9, 1.0), say=lambda *_: None,
                           fixed={"memory.grad_accum": 1, "memory.offload": "none"})
    assert both.config.memory.grad_accum == 1 and both.config.memory.offload == "none"
    with pytest.raises(ConfigError) as exc:     # 3 pipeline stages of a 4-layer GPT on 2 ranks
        autoplan.choose(cfg, _fake_calibration(10e9, 1.0), say=lambda *_: None,
                        fixed={"parallel.pp": 3})
    assert "--pp 3" in str(exc.value) and "fix:" in str(exc.value)


def test_fixed_by_user_reads_only_what_was_given():
    cfg = _auto_cfg()
    given = {("parallel", "tp"), ("memory", "offload")}
    assert autoplan.fixed_by_user(cfg, lambda s, n: (s, n) in given) == {
        "parallel.tp": cfg.parallel.tp, "memory.offload": cfg.memory.offload}
    assert autoplan.fixed_by_user(cfg, lambda s, n: False) == {}


def test_choice_reads_every_setting_the_person_gave():
    """A setting only some layouts read (DDP's --bucket-mb) steers auto to one that reads it; a
    setting the ranked layouts all ignore is refused in one line before anything starts."""
    from shardwise import cli
    from shardwise.config import ConfigError
    from shardwise.launch.checks import given
    base = ["--strategy", "auto", "--n-layer", "4", "--n-embd", "128", "--n-head", "4",
            "--block-size", "16", "--dataset", "synthetic", "--vocab-size", "67",
            "--batch-size", "16"]
    slow = _fake_calibration(1e6, 2.0)               # free, auto picks one process here
    cfg, args = cli.parse_config(base)
    assert autoplan.choose(cfg, slow, say=lambda *_: None,
                           honours=cli._honours(args)).config.parallel.strategy == "single"
    cfg, args = cli.parse_config([*base, "--vocab-size", "256", "--bucket-mb", "4"])
    kept = autoplan.choose(cfg, slow, say=lambda *_: None, honours=cli._honours(args))
    assert kept.config.parallel.strategy == "ddp" and kept.config.parallel.bucket_mb == 4
    cfg, args = cli.parse_config([*base, "--virtual-stages", "3"])
    fixed = autoplan.fixed_by_user(cfg, lambda sec, name: given(args, sec, name))
    with pytest.raises(ConfigError) as exc:
        autoplan.choose(cfg, slow, say=lambda *_: None, fixed=fixed, honours=cli._honours(args))
    assert "--virtual-stages 3" in str(exc.value) or "virtual_stages = 3" in str(exc.value)


def test_cli_auto_with_an_ignored_setting_is_one_line_and_no_run_folder(tmp_path, capsys,
                                                                        monkeypatch):
    from shardwise import cli
    monkeypatch.setattr(autoplan, "calibrate", lambda cfg: _fake_calibration(1e6, 2.0))
    code = cli.main(["train", "--strategy", "auto", "--steps", "2", "--n-layer", "2",
                     "--n-embd", "32", "--n-head", "2", "--block-size", "16",
                     "--virtual-stages", "3", "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: parallel.strategy"), err
    assert not os.path.exists(tmp_path / "runs")
