"""Models shardwise did not write, from the command line: ``--model hf:gpt2`` / ``hf:llama``
(built from a config, never downloaded; or loaded from a local safetensors checkpoint) and a
person's own ``package.module:function``.

Each config comes from ``cli.check_train`` (what ``shardwise train`` resolves before launch),
trained with the one loop (``shardwise.run.train.train``) on a small repetitive text corpus, so a
few steps at lr 1e-2 must lower the loss. One forked world of 2 runs hf:gpt2 under ZeRO-3 and
must equal the single-process run (fp32, rtol 1e-5: tests/reference.py says why).
"""
from __future__ import annotations

import pytest
import torch
from dataclasses import replace

from harness import run_world
from reference import ATOL, RTOL
from shardwise.cli import check_train
from shardwise.config import ConfigError
from shardwise.models import build_model
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(300)
TEXT = "the cat sat on the mat. the dog sat on the log. " * 60

USER_MODULE = '''
import torch.nn as nn

class Tiny(nn.Module):
    """Embedding -> MLP -> head; returns a dict, as many models do."""
    def __init__(self, vocab, width):
        super().__init__()
        self.emb, self.mlp = nn.Embedding(vocab, width), nn.Sequential(nn.Linear(width, width), nn.GELU())
        self.head = nn.Linear(width, vocab)

    def forward(self, idx):
        return {"logits": self.head(self.mlp(self.emb(idx))), "aux": None}

def build(cfg):                 # takes the ModelConfig
    return Tiny(cfg.vocab_size, cfg.n_embd)

def build_plain():              # takes nothing; returns a tuple-output model
    class T(Tiny):
        def forward(self, idx):
            return (super().forward(idx)["logits"],)
    return T(256, 16)

def not_a_model(cfg):
    return 3
'''


@pytest.fixture()
def corpus(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(TEXT)
    return path


def argv(corpus, tmp_path, model, *extra) -> list[str]:
    return ["--model", model, "--dataset", "text", "--data-path", str(corpus), "--token-cache",
            str(tmp_path / "cache"), "--strategy", "single", "--n-layer", "2", "--n-embd", "32",
            "--n-head", "4", "--block-size", "16", "--batch-size", "8", "--steps", "6", "--lr",
            "1e-2", "--warmup-steps", "0", "--lr-schedule", "constant", "--eval-every", "0",
            "--eval-batches", "1", "--device", "cpu", "--no-progress", "--out-dir",
            str(tmp_path / "runs"), *extra]


def trains(cfg) -> list[float]:
    losses = train(cfg, init_runtime(cfg), quiet=True)["losses"]
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.3, losses       # six steps on repeated text: clearly lower
    return losses


@pytest.mark.parametrize("family", ["hf:gpt2", "hf:llama"])
def test_hf_models_train_from_the_cli_config(family, corpus, tmp_path):
    cfg, _, _ = check_train(argv(corpus, tmp_path, family))
    model = build_model(cfg.model, 0)
    kind = {"hf:gpt2": "GPT2LMHeadModel", "hf:llama": "LlamaForCausalLM"}[family]
    assert type(model).__name__ == kind and model.config.vocab_size == 256
    assert model.config.num_hidden_layers == 2 and model.config.hidden_size == 32
    trains(cfg)


def test_hf_weights_load_from_a_local_safetensors_folder(corpus, tmp_path):
    cfg, _, _ = check_train(argv(corpus, tmp_path, "hf:gpt2"))
    saved = build_model(cfg.model, seed=7)
    saved.save_pretrained(tmp_path / "ckpt", safe_serialization=True)   # config.json + weights
    loaded_cfg, _, _ = check_train(argv(corpus, tmp_path, "hf:gpt2", "--hf-weights",
                                        str(tmp_path / "ckpt")))
    loaded = build_model(loaded_cfg.model, seed=0)                      # another seed's init...
    for (name, a), (_, b) in zip(saved.state_dict().items(), loaded.state_dict().items()):
        assert torch.equal(a, b), name                                  # ...replaced by the file
    assert loaded.lm_head.weight is loaded.transformer.wte.weight       # still tied
    with pytest.raises(ConfigError, match=r"model\.n_embd = 64: the config file says n_embd = 32"):
        check_train([*argv(corpus, tmp_path, "hf:gpt2", "--hf-weights", str(tmp_path / "ckpt")),
                     "--n-embd", "64"])
    (tmp_path / "ckpt" / "config.json").unlink()     # built from the flags: 64 wide, file 32
    with pytest.raises(ConfigError, match=r"model\.hf_weights = .*has shape"):
        check_train([*argv(corpus, tmp_path, "hf:gpt2", "--hf-weights", str(tmp_path / "ckpt")),
                     "--n-embd", "64"])


def test_user_module_function_models_train(corpus, tmp_path, monkeypatch):
    (tmp_path / "my_models.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg, _, _ = check_train(argv(corpus, tmp_path, "my_models:build"))
    assert type(build_model(cfg.model, 0)).__name__ == "Tiny"
    trains(cfg)
    plain, _, _ = check_train(argv(corpus, tmp_path, "my_models:build_plain"))
    trains(replace(plain, train=replace(plain.train, steps=4)))
    no_plan = [a for a in argv(corpus, tmp_path, "my_models:build") if a not in ("--strategy", "single")]
    with pytest.raises(ConfigError, match=r"parallel\.tp = 2: .*has no model plan"):
        check_train(no_plan + ["--strategy", "tp", "--tp", "2", "--nproc-per-node", "2"])
    for name, why in (("my_models:not_a_model", "returned a int, not an nn.Module"),
                      ("my_models:missing", "has no function 'missing'"),
                      ("no_such_pkg.models:build", "cannot be imported")):
        with pytest.raises(ConfigError, match=why):
            build_model(replace(cfg.model, name=name), 0)


def test_layouts_hf_models_cannot_run_yet_are_refused(corpus, tmp_path):
    args = [a for a in argv(corpus, tmp_path, "hf:llama") if a not in ("--strategy", "single")]
    with pytest.raises(ConfigError, match=r"parallel\.strategy = .*not supported yet"):
        check_train(args + ["--strategy", "auto"])
    own = [a for a in argv(corpus, tmp_path, "my_models:build") if a not in ("--strategy", "single")]
    with pytest.raises(ConfigError, match=r"parallel\.pp = 2: pipeline parallelism .*own models"):
        check_train(own + ["--strategy", "pp", "--pp", "2", "--nproc-per-node", "2"])
    # the pipeline cuts HF models by their plans (tests/parallel/test_hf_layouts.py)
    cfg, _, world = check_train(args + ["--strategy", "pp", "--pp", "2", "--nproc-per-node", "2"])
    assert (cfg.parallel.pp, world) == (2, 2)
    # tensor parallelism and checkpointing read the model's plan (shardwise/models/plans.py)
    cfg, _, world = check_train(args + ["--strategy", "tp", "--tp", "2", "--nproc-per-node", "2",
                                        "--activation-checkpointing"])
    assert (cfg.parallel.tp, world, cfg.memory.activation_checkpointing) == (2, 2, True)


def _zero3(rank, n, cfg):
    return train(cfg, init_runtime(cfg), quiet=True)["losses"]


def test_hf_gpt2_under_zero3_in_a_world_of_two_equals_one_process(corpus, tmp_path):
    args = [a for a in argv(corpus, tmp_path, "hf:gpt2") if a not in ("--strategy", "single")]
    cfg, _, world = check_train(args + ["--strategy", "zero3", "--nproc-per-node", "2",
                                        "--steps", "4"])
    assert world == 2 and cfg.parallel.zero_stage == 3
    single = replace(cfg, parallel=replace(cfg.parallel, strategy="single"))
    expected = train(single, init_runtime(single), quiet=True)["losses"]
    got = run_world(_zero3, 2, cfg)
    for losses in got:    # reduce-scatter sums in another order than one backward: rtol 1e-5
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=RTOL,
                                   atol=ATOL)
