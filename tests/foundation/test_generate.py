"""``shardwise generate``: sample from a run's final weights or its checkpoint, refuse bad input.

One tiny run (our GPT, 1 layer, bytes tokenizer, 6 steps, checkpoints) is trained in this
process through the CLI; generation must then equal greedy decoding with the trained model
itself (the engine's parameters: what the loop left, not what generate loaded), give the same
text from ``final.safetensors`` and from the checkpoint, and be reproducible for a seed.
"""
import os
import shutil

import pytest
import torch

from shardwise import cli


from shardwise.run import generate
pytestmark = pytest.mark.timeout(180)
TEXT = "the quick brown fox jumps over the lazy dog. " * 40
PROMPT = "the quick"


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gen")
    (root / "corpus.txt").write_text(TEXT)
    code = cli.main(["train", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head",
                     "2", "--block-size", "16", "--dataset", "text", "--data-path",
                     str(root / "corpus.txt"), "--token-cache", str(root / "cache"),
                     "--strategy", "single", "--steps", "6", "--batch-size", "4", "--lr",
                     "1e-2", "--device", "cpu", "--out-dir", str(root), "--run-name", "r",
                     "--checkpoint-dir", str(root / "ck"), "--no-progress",
                     "--eval-every", "0"])
    assert code == 0
    return root


def _greedy_with(params: dict, cfg, ids: list[int], n: int) -> list[int]:
    from shardwise.models import build_model
    model = build_model(cfg.model, seed=999)                   # other weights, then the run's
    model.load_state_dict(params, strict=False)
    model.eval()
    idx = torch.tensor([ids])
    with torch.no_grad():
        for _ in range(n):
            nxt = model(idx[:, -cfg.model.block_size:])[0, -1].argmax()
            idx = torch.cat([idx, nxt.view(1, 1)], dim=1)
    return idx[0, len(ids):].tolist()


def test_generate_from_final_and_checkpoint(run, capsys):
    from safetensors.torch import load_file
    folder = str(run / "r")
    assert os.path.isfile(os.path.join(folder, "final.safetensors"))
    assert cli.main(["generate", "--run", folder, "--prompt", PROMPT, "--max-new-tokens", "24",
                     "--temperature", "0"]) == 0
    out = capsys.readouterr()
    assert "final.safetensors" in out.err
    cfg = generate.load_run(folder)
    want = _greedy_with(load_file(os.path.join(folder, "final.safetensors")), cfg,
                        list(PROMPT.encode()), 24)
    assert out.out.rstrip("\n") == PROMPT + bytes(want).decode("utf-8", errors="replace")
    # the checkpoint (step 6, the end) holds the same weights: the same greedy text
    text_final, _ = generate.generate(folder, PROMPT, 24, temperature=0)
    moved = str(run / "final.moved")
    shutil.move(os.path.join(folder, "final.safetensors"), moved)
    try:
        text_ck, source = generate.generate(folder, PROMPT, 24, temperature=0)
        assert source.startswith("checkpoint") and text_ck == text_final
        a = generate.generate(folder, PROMPT, 24, temperature=1.0, top_k=5, seed=3)[0]
        assert a == generate.generate(folder, PROMPT, 24, temperature=1.0, top_k=5, seed=3)[0]
        shutil.move(str(run / "ck"), str(run / "ck.moved"))
        try:               # neither final weights nor a checkpoint: refused
            assert cli.main(["generate", "--run", folder, "--prompt", PROMPT]) == 2
            err = capsys.readouterr().err.strip()
            assert len(err.splitlines()) == 1 and "holds no weights" in err, err
        finally:
            shutil.move(str(run / "ck.moved"), str(run / "ck"))
    finally:
        shutil.move(moved, os.path.join(folder, "final.safetensors"))


@pytest.mark.parametrize("argv, says", [
    (["--run", "{root}/missing", "--prompt", "x"], "is not a directory"),
    (["--run", "{root}", "--prompt", "x"], "holds no config.json"),
    (["--run", "{root}/r", "--prompt", ""], "encodes to no token"),
    (["--run", "{root}/r", "--prompt", "x" * 17], "longer than the model's window"),
    (["--run", "{root}/r", "--prompt", "x", "--max-new-tokens", "0"], "must be at least 1"),
    (["--run", "{root}/r", "--prompt", "x", "--temperature", "-1"], "finite number >= 0"),
    (["--run", "{root}/r", "--prompt", "x", "--top-k", "-2"], "must be >= 0"),
    (["--prompt", "x"], "--run"),
])
def test_bad_input_is_one_line(run, capsys, argv, says):
    argv = [a.format(root=run) for a in argv]
    try:
        code = cli.main(["generate", *argv])
    except SystemExit as exc:          # argparse's own refusals (a missing flag)
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert says in err, err


def test_tokens_outside_the_vocabulary_are_refused(run):
    from dataclasses import replace
    from shardwise.config import ConfigError
    from shardwise.data.tokenize import ByteTokenizer
    cfg = generate.load_run(str(run / "r"))
    small = replace(cfg, model=replace(cfg.model, vocab_size=128))
    with pytest.raises(ConfigError, match="outside the model's vocabulary of 128"):
        generate.encode_prompt(ByteTokenizer(), "café", small)     # é: bytes 195, 169
