"""Rough edges a user hits (issue 29): each ends in one line that names the field, why and the
fix (exit 2 from the CLI), or works.

* a parameter that gets no gradient in a step, under every data-parallel stage: the line names
  exactly the unused parameters (never the used ones) and the setting that handles them;
* settings the run would accept and ignore are refused when the person gave them;
* ``--strategy auto`` keeps the axis and memory flags a person gave, or refuses them;
* a pipeline over a module that wraps a Hugging Face model is refused with one line.
"""
import pytest
import torch
import torch.nn as nn

from harness import run_world

from shardwise.cli import main

pytestmark = pytest.mark.timeout(240)


class Branchy(nn.Module):
    """``extra`` never takes part in forward: its two parameters get no gradient."""

    def __init__(self):
        super().__init__()
        self.body, self.extra = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x):
        return self.body(x)


def _unused(rank, n, strategies):
    import shardwise
    from shardwise.config import Config, ParallelConfig, TrainConfig
    out = {}
    for strategy in strategies:
        torch.manual_seed(0)
        cfg = Config(parallel=ParallelConfig(strategy=strategy),
                     train=TrainConfig(batch_size=4, device="cpu"))
        engine = shardwise.prepare(Branchy(), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg,
                                   loss_fn=nn.functional.cross_entropy)
        x, y = engine.shard(torch.randn(4, 6), torch.tensor([0, 1, 2, 0]))
        try:
            engine.train_step(x, y)
            out[strategy] = None
        except RuntimeError as exc:
            from shardwise.config import ConfigError
            out[strategy] = (str(exc), isinstance(exc, ConfigError))
        engine.close()
    return out


def test_unused_parameters_are_named_in_one_line_under_every_stage():
    strategies = ["ddp", "zero1", "zero2", "zero3"]
    for res in run_world(_unused, 2, strategies):
        for strategy in strategies:
            assert res[strategy] is not None, strategy
            msg, is_config_error = res[strategy]
            assert is_config_error and "\n" not in msg, msg         # the CLI's one line
            assert "extra.weight" in msg and "extra.bias" in msg, msg
            assert "body." not in msg, msg                            # used ones never blamed
            assert "2 trainable parameter(s)" in msg and "fix:" in msg, msg
            flag = "--find-unused" if strategy == "ddp" else "requires_grad_(False)"
            assert flag in msg, msg


def test_ddp_with_one_replica_leaves_an_unused_parameter_alone_like_pytorch():
    # dp = 1 has nothing to wait for: the step equals plain PyTorch (the unused one unmoved,
    # even by weight decay), so --find-unused has nothing to do there (and is refused)
    res = run_world(_unused, 1, ["ddp"])
    assert res[0]["ddp"] is None


IGNORED = [   # (flags, the field named, a word of the fix); each accepted and ignored before
    (["--lora-alpha", "16"], "memory.lora_alpha = 16.0", "--lora-rank"),     # the default, given
    (["--lora-alpha", "32"], "memory.lora_alpha = 32.0", "--lora-rank"),
    (["--strategy", "ps", "--num-ps", "1", "--staleness", "3"], "parallel.staleness = 3",
     "--ps-mode ssp"),
    (["--strategy", "ps", "--num-ps", "1", "--ps-mode", "async", "--on-worker-failure",
      "continue"], "parallel.on_worker_failure = 'continue'", "--ps-mode sync"),
    (["--keep", "5"], "train.keep_checkpoints = 5", "--checkpoint-dir"),
    (["--model", "lenet", "--dataset", "digits", "--n-layer", "8"], "model.n_layer = 8",
     "drop --n-layer"),
    (["--model", "lenet", "--dataset", "digits", "--block-size", "64"], "model.block_size = 64",
     "drop --block-size"),
    (["--model", "lenet", "--dataset", "digits", "--vocab-size", "512"],
     "model.vocab_size = 512", "drop --vocab-size"),
    (["--allreduce", "ring", "--nproc-per-node", "1"], "parallel.allreduce = 'ring'", "dp >= 2"),
    (["--grad-compression", "bf16", "--nproc-per-node", "1"], "parallel.grad_compression = 'bf16'", "dp >= 2"),
    (["--bucket-mb", "4", "--nproc-per-node", "1"], "parallel.bucket_mb = 4.0", "dp >= 2"),
    (["--find-unused", "--nproc-per-node", "1"], "parallel.find_unused = True", "dp >= 2"),
    (["--strategy", "tp", "--tp", "2", "--nproc-per-node", "2", "--bucket-mb", "4"],
     "parallel.bucket_mb = 4.0", "dp >= 2"),
]


@pytest.mark.parametrize("argv,names,fix", IGNORED)
def test_an_ignored_setting_is_refused_in_one_line(argv, names, fix, capsys):
    code = main(["train", *argv, "--print-config"])     # refused before it prints, or 0
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.count("\n") == 0, err
    assert err.startswith("error: ") and names in err and "fix:" in err and fix in err, err


@pytest.mark.parametrize("argv", [
    ["--strategy", "ddp", "--nproc-per-node", "2", "--bucket-mb", "4", "--find-unused",
     "--allreduce", "ring", "--grad-compression", "bf16"],          # dp = 2 reads them all
    ["--lora-rank", "4", "--lora-targets", "*attn.qkv", "--lora-alpha", "8"],
    ["--checkpoint-dir", "/tmp/shardwise-rough-edges-ckpt", "--keep", "2"],
    ["--strategy", "ps", "--num-ps", "1", "--ps-mode", "ssp", "--staleness", "3"],
    ["--model", "lenet", "--dataset", "digits"],                    # defaults never count
])
def test_a_read_setting_passes(argv, capsys):
    from shardwise.cli import check_train
    check_train(["--steps", "1", *argv])    # raises ConfigError when refused


UNUSED_MODEL = '''
import torch.nn as nn


class Lm(nn.Module):
    """A token model whose ``extra`` layer never takes part in forward."""

    def __init__(self, cfg):
        super().__init__()
        self.emb = nn.Embedding(cfg.vocab_size, 16)
        self.head = nn.Linear(16, cfg.vocab_size)
        self.extra = nn.Linear(16, 16)

    def forward(self, x):
        return self.head(self.emb(x))


def build(cfg):
    return Lm(cfg)
'''


def test_unused_parameter_in_a_world_of_one_is_one_line(tmp_path, monkeypatch, capsys):
    """Through the CLI in this process (a world of one): ZeRO names the unused parameters in
    one line and exits 2, no traceback."""
    (tmp_path / "unused_lm.py").write_text(UNUSED_MODEL)
    monkeypatch.syspath_prepend(str(tmp_path))
    code = main(["train", "--model", "unused_lm:build", "--strategy", "zero2",
                 "--nproc-per-node", "1", "--dataset", "synthetic", "--steps", "2",
                 "--block-size", "8", "--vocab-size", "32", "--batch-size", "4",
                 "--eval-every", "0", "--device", "cpu", "--no-progress",
                 "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and "extra.weight" in lines[0] and "Traceback" not in err, err


class WrapsGPT2(nn.Module):
    """A user's module that holds a Hugging Face GPT-2 and returns only its logits."""

    def __init__(self):
        super().__init__()
        from models_hf import tiny_gpt2
        self.gpt = tiny_gpt2(0)

    def forward(self, x):
        return self.gpt(x).logits


def _pipeline_over_wrapper(rank, n):
    import shardwise
    from shardwise.config import Config, ParallelConfig, TrainConfig
    from shardwise.models.plans import plan_of
    cfg = Config(parallel=ParallelConfig(strategy="pp", pp=2, num_microbatches=2),
                 train=TrainConfig(batch_size=4, device="cpu"))
    out = {}
    for case in ("unregistered", "registered with GPT-2's plan"):
        if case != "unregistered":           # the fix a person tries first: the inner plan
            shardwise.register_plan(WrapsGPT2, plan_of(WrapsGPT2().gpt))
        try:
            shardwise.prepare(WrapsGPT2(), lambda ps: torch.optim.SGD(ps, lr=0.1), cfg,
                              loss_fn=nn.functional.cross_entropy)
            out[case] = None
        except Exception as exc:            # noqa: BLE001 - the type is what is asserted
            out[case] = (type(exc).__name__, str(exc))
    return out


def test_a_pipeline_over_a_module_wrapping_hf_gpt2_is_refused_in_one_line():
    pytest.importorskip("transformers")
    for res in run_world(_pipeline_over_wrapper, 2):
        for case, got in res.items():
            assert got is not None, case
            kind, msg = got
            assert kind == "TypeError" and "\n" not in msg, (case, kind, msg)
            assert "WrapsGPT2" in msg and "fix:" in msg, msg
            assert "shardwise.register_plan(WrapsGPT2" in msg, msg
        msg = res["registered with GPT-2's plan"][1]
        assert "'transformer.h'" in msg and "GPT2LMHeadModel at 'gpt'" in msg, msg
        assert "pass the GPT2LMHeadModel itself" in msg, msg


def _subclass_pipeline(rank, n):
    import shardwise
    from models_hf import tiny_gpt2
    from reference import tiny_config
    from dataclasses import replace
    from transformers import GPT2LMHeadModel

    class LogitsOnly(GPT2LMHeadModel):
        def forward(self, input_ids):
            return super().forward(input_ids=input_ids).logits

    model = tiny_gpt2(0)
    model.__class__ = LogitsOnly
    cfg = tiny_config("pp", pp=2)
    cfg = replace(cfg, logging=replace(cfg.logging, schedule_png="off"))
    try:
        shardwise.prepare(model, lambda ps: __import__("torch").optim.SGD(ps, lr=0.1), cfg)
    except TypeError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_a_pipeline_over_a_subclass_that_overrides_forward_is_refused_not_hung():
    """A subclass of GPT2LMHeadModel whose forward returns only the logits: the pipeline runs
    the plan's pieces, not that forward, so the loss saw a ModelOutput on the last stage only
    and the other stage waited for it; now every rank refuses in one line before any split."""
    from harness import run_world
    for message in run_world(_subclass_pipeline, 2):
        assert message is not None and "\n" not in message
        assert "LogitsOnly.forward" in message and "fix:" in message
