"""``shardwise generate`` runs on a device: ``--device auto|cpu|cuda`` (default: the run's own
``train.device``), the model and the tokens there, each token chosen on the CPU.

One tiny CPU run is trained through the CLI. On this CPU machine: ``--device cpu`` gives the
same text as the default; ``--device cuda`` is refused in one line; ``auto`` picks CUDA when it
is (pretended) present and never touches CUDA for ``cpu``; the model is built on the device
asked for ('meta' stands for a second device) and the tokens follow the model's device.
"""
import pytest
import torch

from shardwise import cli


from shardwise.run import generate
pytestmark = pytest.mark.timeout(180)
PROMPT = "the quick"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gendev")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert cli.main(["train", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head",
                     "2", "--block-size", "16", "--dataset", "text", "--data-path",
                     str(root / "corpus.txt"), "--token-cache", str(root / "cache"),
                     "--strategy", "single", "--steps", "3", "--batch-size", "4", "--lr",
                     "1e-2", "--device", "cpu", "--out-dir", str(root), "--run-name", "r",
                     "--no-progress", "--eval-every", "0"]) == 0
    return str(root / "r")


def test_device_cpu_equals_default(run, capsys):
    args = ["generate", "--run", run, "--prompt", PROMPT, "--max-new-tokens", "12", "--seed", "3"]
    assert cli.main(args) == 0
    default = capsys.readouterr().out
    assert cli.main(args + ["--device", "cpu"]) == 0
    assert capsys.readouterr().out == default and default.startswith(PROMPT)
    text, _ = generate.generate(run, PROMPT, 12, seed=3, device="cpu")
    assert text + "\n" == default


def test_device_cuda_without_gpu_is_refused(run, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["generate", "--run", run, "--prompt", PROMPT, "--device", "cuda"]) == 2
    err = capsys.readouterr().err
    assert "--device" in err and "no CUDA device is visible" in err


def test_auto_picks_cuda_when_present_and_cpu_never_touches_it(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert generate.pick_device("auto") == torch.device("cuda", 0)
    assert generate.pick_device("cuda") == torch.device("cuda", 0)

    def touched():
        raise AssertionError("CUDA touched for --device cpu")
    monkeypatch.setattr(torch.cuda, "is_available", touched)
    monkeypatch.setattr(torch.cuda, "current_device", touched)
    assert generate.pick_device("cpu") == torch.device("cpu")


def test_model_is_built_on_the_device_and_tokens_follow_it(run):
    cfg = generate.load_run(run)
    state, _ = generate.weights(cfg, run)
    model = generate.build(cfg, state, torch.device("meta"))
    assert {p.device.type for p in model.parameters()} == {"meta"}

    class Probe(torch.nn.Module):
        """Records where its input lives; logits on that device (here: meta)."""
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.zeros(1, device="meta"))
            self.seen = []

        def forward(self, idx):
            self.seen.append(idx.device.type)
            return torch.zeros(*idx.shape, 5, device=idx.device)
    probe = Probe()
    with pytest.raises(NotImplementedError):   # meta logits have no values to read back
        generate.sample(probe, [1, 2], 2, 16, 0.0, 0, 0)
    assert probe.seen == ["meta"]              # the tokens went to the model's device
