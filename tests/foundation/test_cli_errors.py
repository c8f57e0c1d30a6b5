"""Every bad value stops before any process starts: one line naming field, value and fix; exit 2."""
import os
import subprocess
import sys

import pytest

from shardwise.cli import main

BAD = [
    (["--strategy", "fsdp9"], "parallel.strategy = 'fsdp9'", "choose one of"),
    (["--steps", "-5"], "train.steps = -5", "give a number > 0"),
    (["--steps", "ten"], "train.steps = 'ten'", "give a number"),
    (["--strategy", "ddp", "--nproc-per-node", "4", "--dp", "3"], "parallel.dp = 3",
     "make the product equal the number of processes"),
    (["--strategy", "tp", "--tp", "3", "--nproc-per-node", "3"], "parallel.tp = 3",
     "pick a tp that divides the number of heads"),
    (["--n-head", "5"], "model.n_head = 5", "n_embd / n_head is whole"),
    (["--dataset", "mnist", "--model", "lenet", "--data-dir", "/no/such/dir"],
     "data.data_dir = '/no/such/dir'", "give an existing directory"),
    (["--dataset", "mnist", "--model", "lenet"], "data.data_dir = ''", "--data-dir"),
    (["--batch-size", "7", "--nproc-per-node", "2"], "train.batch_size = 7", "multiple of dp"),
    (["--lr", "0"], "train.lr = 0.0", "must be positive"),
    (["--strategy", "zero2", "--offload", "disk", "--checkpoint-async", "--checkpoint-dir",
      "/tmp/shardwise-never-written"], "train.checkpoint_async = True", "drop --checkpoint-async"),
    (["--strategy", "zero3", "--checkpoint-move-last", "--checkpoint-dir",
      "/tmp/shardwise-never-written"], "train.checkpoint_move_last = True",
     "--offload disk and no --tp / --pp"),
    (["--strategy", "zero3", "--offload", "disk", "--checkpoint-move-last"],
     "train.checkpoint_move_last = True: needs a folder", "add --checkpoint-dir"),
    (["--optimizer", "adamw8bit", "--optimizer-kernel", "loop"], "train.optimizer_kernel = 'loop'",
     "use --optimizer adamw"),
    (["--optimizer-kernel", "triton"], "train.optimizer_kernel = 'triton'", "choose one of"),
    (["--model", "lenet"], "data.dataset = 'stdlib'", "digits"),
    (["--strategy", "pp", "--pp", "2", "--stage-layers", "1,1"], "parallel.stage_layers = '1,1'",
     "one count per stage"),
    (["--strategy", "ps", "--num-ps", "1", "--num-workers", "2", "--straggler", "5:2"],
     "parallel.straggler = '5:2'", "workers 0..1"),
    (["--strategy", "ddp", "--tp", "2"], "parallel.tp = 2", "drop --strategy"),
    # presets against axis flags and stages (shardwise/parallel/layout.py)
    (["--strategy", "zero3", "--zero-stage", "1"], "parallel.zero_stage = 1", "drop --strategy"),
    (["--zero-stage", "5"], "parallel.zero_stage = 5", "use 0 (DDP), 1, 2 or 3"),
    (["--strategy", "ps", "--zero-stage", "1"], "parallel.zero_stage = 1", "drop --zero-stage"),
    (["--model", "lenet", "--dataset", "digits", "--tp", "2"], "parallel.tp = 2", "--dp"),
    (["--zero-stage", "3", "--zero3-units", "Block,2x"], "parallel.zero3_units = 'Block,2x'",
     "module class names"),
    (["--block-size", "300000"], "model.block_size = 300000", "shorter block_size"),
    (["--out-dir", "/etc/hostname/runs"], "logging.out_dir = '/etc/hostname/runs'", "you can write to"),
    (["--strategy", "dp", "--batch-size", "10", "--grad-accum", "2"], "memory.grad_accum = 2",
     "multiple of shards x grad_accum"),
    # settings the chosen layout would silently ignore
    (["--strategy", "ddp", "--offload", "cpu"], "memory.offload = 'cpu'", "drop --offload"),
    (["--strategy", "zero3", "--bucket-mb", "4"], "parallel.bucket_mb = 4.0", "drop --bucket-mb"),
    (["--strategy", "pp", "--pp", "2", "--find-unused"], "parallel.find_unused = True",
     "drop --find-unused"),
    (["--zero-stage", "3", "--offload-dir", "/tmp"], "memory.offload_dir = '/tmp'",
     "--offload disk"),
    (["--strategy", "3d", "--dp", "1", "--pp", "2", "--zero-stage", "1", "--zero3-units",
      "Block"], "parallel.zero3_units = 'Block'", "drop --zero3-units"),
    (["--strategy", "zero1", "--grad-compression", "bf16"], "parallel.grad_compression = 'bf16'",
     "drop --grad-compression"),
    (["--strategy", "ddp", "--ps-mode", "async"], "parallel.ps_mode = 'async'", "drop --ps-mode"),
    (["--strategy", "zero2", "--zero3-units", "Block"], "parallel.zero3_units = 'Block'",
     "drop --zero3-units"),
    (["--strategy", "ddp", "--num-microbatches", "8"], "parallel.num_microbatches = 8",
     "--pp 2 or more"),
    (["--strategy", "zero2", "--allreduce", "shm"], "parallel.allreduce = 'shm'",
     "--zero-stage 0, whose all-reduce it serves"),
    (["--strategy", "ddp", "--pp-transport", "shm"], "parallel.pp_transport = 'shm'",
     "--pp 2 or more"),
    # --offload-params: ZeRO-3 with an offload place only
    (["--strategy", "zero2", "--offload", "disk", "--offload-params"],
     "memory.offload_params = True", "use --zero-stage 3"),
    (["--strategy", "zero3", "--offload-params"], "memory.offload_params = True",
     "with --offload cpu or disk"),
    (["--strategy", "ddp", "--offload-params"], "memory.offload_params = True",
     "drop --offload-params"),
    # non-finite numbers
    (["--weight-decay", "nan"], "train.weight_decay = nan", "give a number"),
    (["--lr", "inf"], "train.lr = inf", "give a number"),
    (["--grad-clip", "-1"], "train.grad_clip = -1.0", "give a number >= 0"),
]


@pytest.mark.parametrize("argv,names,fix", BAD)
def test_bad_value_is_one_clear_line(argv, names, fix, capsys):
    code = main(["train", *argv])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.count("\n") == 0, err
    assert err.startswith("error: ") and names in err and "fix:" in err and fix in err, err


def test_cuda_without_a_gpu(capsys):
    import torch
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the check cannot fire")
    assert main(["train", "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "train.device = 'cuda'" in err and "--device cpu" in err


def test_unknown_flag_is_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["train", "--stepz", "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--stepz" in err and "fix:" in err


def test_bad_config_file(tmp_path, capsys):
    f = tmp_path / "run.toml"
    f.write_text("[train]\nstepz = 3\n")
    assert main(["train", "--config", str(f)]) == 2
    err = capsys.readouterr().err
    assert "train.stepz" in err and "unknown field" in err
    f.write_text("[train\n")
    assert main(["train", "--config", str(f)]) == 2
    assert "cannot be parsed" in capsys.readouterr().err
    assert main(["train", "--config", str(tmp_path / "none.yaml")]) == 2


def test_config_file_then_flags(tmp_path, capsys):
    f = tmp_path / "run.yaml"
    f.write_text("train:\n  steps: 7\n  lr: 0.5\nmodel:\n  n_layer: 3\n")
    assert main(["train", "--config", str(f), "--steps", "9", "--print-config"]) == 0
    out = capsys.readouterr().out
    assert '"steps": 9' in out and '"lr": 0.5' in out and '"n_layer": 3' in out


def test_help_documents_every_field(capsys):
    from shardwise.config import flag_of, section_fields
    with pytest.raises(SystemExit) as exc:
        main(["train", "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for _, f in section_fields():
        assert flag_of(f) in out, f.name


def test_real_process_exit_code_and_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    p = subprocess.run([sys.executable, "-m", "shardwise.cli", "train", "--strategy", "nope"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 2
    assert "Traceback" not in p.stderr and p.stderr.startswith("error: parallel.strategy")
    assert p.stdout == ""  # nothing was launched


FUZZ = [  # configurations a fuzz of 250 random ones turned into tracebacks (issue 14)
    (["--steps", "1e400"], "train.steps = '1e400'", "give a number"),
    (["--seed", "-1"], "train.seed = -1", "0 <= seed < 2**32"),
    (["--seed", "99999999999999999999"], "train.seed = 99999999999999999999", "0 <= seed"),
    (["--vocab-size", "100"], "model.vocab_size = 100", "--vocab-size 256"),
    (["--schedule-png", "/etc/hostname/x.png", "--strategy", "pp", "--pp", "2"],
     "logging.schedule_png = '/etc/hostname/x.png'", "you can write to"),
]


@pytest.mark.parametrize("argv,names,fix", FUZZ)
def test_fuzz_cases_are_one_clear_line(argv, names, fix, capsys):
    test_bad_value_is_one_clear_line(argv, names, fix, capsys)


@pytest.mark.parametrize("text,suffix", [("- 1\n- 2\n", ".yaml"), ("1: 2\n", ".yaml"),
                                         ("train:\n  3: 4\n", ".yaml")])
def test_config_files_that_are_not_mappings_of_names(tmp_path, text, suffix, capsys):
    path = tmp_path / f"bad{suffix}"
    path.write_text(text)
    assert main(["train", "--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: --config") and "fix:" in err, err


def test_a_loss_that_turns_nan_stops_the_run_naming_the_step(tmp_path, capsys):
    code = main(["train", "--strategy", "single", "--lr", "1e6", "--warmup-steps", "0",
                 "--steps", "30", "--n-layer", "1", "--n-embd", "16", "--n-head", "2",
                 "--block-size", "16", "--batch-size", "4", "--eval-batches", "1",
                 "--dataset", "synthetic", "--no-progress", "--out-dir", str(tmp_path),
                 "--run-name", "nan"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1
    assert len(err) == 1 and err[0].startswith("error: the training loss is nan at step "), err
    import json
    lines = [json.loads(line) for line in open(tmp_path / "nan" / "metrics.jsonl")]
    assert lines[-1]["loss"] is None and lines[-1]["nonfinite"] == ["loss"]


def test_offload_dir_without_room_is_refused_with_the_bytes_needed(tmp_path, monkeypatch, capsys):
    """offload=disk on a filesystem with less room than the state: refused before launch, one
    line with the bytes needed (parameters x bytes per element; memory/checks.py)."""
    import shutil
    from collections import namedtuple
    from shardwise.launch.checks import parameter_count
    from shardwise.memory.checks import offload_bytes_per_element
    from shardwise.cli import parse_config
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 4096, 4096))
    argv = ["--strategy", "zero3", "--offload", "disk", "--offload-params", "--offload-dir",
            str(tmp_path / "off"), "--out-dir", str(tmp_path / "runs")]
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    cfg = parse_config(argv)[0]
    needed = parameter_count(cfg) * offload_bytes_per_element(cfg)   # 2 of 2 ranks here
    assert offload_bytes_per_element(cfg) == 16                      # fp32 Adam, params too
    from shardwise.models import build_model
    assert parameter_count(cfg) == sum(p.numel() for p in build_model(cfg.model, 0).parameters())
    assert err.count("\n") == 0 and err.startswith("error: memory.offload_dir = ")
    assert f"needs {needed:,} bytes" in err and "has 4,096 free" in err and "fix:" in err
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**12, 0, 10**12))
    assert main(["train", *argv, "--print-config"]) == 0              # room: it goes ahead


def test_offload_sync_without_disk_offload_is_refused(tmp_path, capsys):
    """``--offload-sync`` says when disk offload's writes reach the disk: without ``--offload
    disk`` it would change nothing, so it is refused in one line naming the field."""
    assert main(["train", "--strategy", "zero3", "--offload", "cpu", "--offload-sync", "kernel",
                 "--out-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("error: memory.offload_sync = 'kernel'")
    assert "offload cpu" in err and "fix:" in err
