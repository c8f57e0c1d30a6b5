"""Generation with a key-value cache equals generation without it, token for token.

The reference is the no-cache path: every step runs the model on the last ``block_size`` tokens
(shardwise/models/decode.py). Checked on shardwise's GPT (its KVCache) and on Hugging Face GPT-2
and Llama (their own cache), greedy and sampled, with prompts whose continuation outgrows the
window (the cache must then recompute the window as the reference does), batched prompts equal
to the same prompts alone, and a forward hook proving the cached path really feeds one token per
step. Then the CLI: ``--prompts-file`` (one JSON line per prompt, equal to ``--prompt`` alone
and to ``--no-cache``), tokens/s on stderr, and bad files refused in one line (exit 2).

Tolerances: the cached step attends one query to stored keys where the reference computes the
whole causal matrix, so logits agree to fp32 rounding (atol 1e-5 on logits up to ~5: a few
float32 ulps at that size, 2.4e-6 seen); a
prefill of the same tokens runs the very same kernels as the reference, so it is compared
exactly.
"""
import json

import pytest
import torch

from shardwise import cli

from shardwise.run import generate
from shardwise.config import ModelConfig
from shardwise.models import build_model
from shardwise.models.decode import Decoder, sample_batch
from shardwise.models.gpt import GPT, GPTConfig, KVCache

pytestmark = pytest.mark.timeout(240)
WINDOW = 16
VOCAB = 64


def _model(name: str):
    """A small model with weights of std 0.3: at the usual 0.02 a random GPT-2 or Llama repeats
    one token greedily, which would make 'the same tokens' a weak check."""
    if name == "gpt":
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=WINDOW,
                              vocab_size=VOCAB))
    else:
        pytest.importorskip("transformers")
        model = build_model(ModelConfig(name=name, n_layer=2, n_embd=32, n_head=4,
                                        block_size=WINDOW, vocab_size=VOCAB), seed=0)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.3, generator=g)
    return model.eval()


def _fed_lengths(model):
    """A list that records how many tokens each forward call is given."""
    fed = []

    def hook(module, args, kwargs):
        ids = args[0] if args else kwargs["input_ids"]
        fed.append(ids.shape[1])
    model.register_forward_pre_hook(hook, with_kwargs=True)
    return fed


def test_gpt_cache_logits_equal_the_full_forward():
    model = _model("gpt")
    idx = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(1))
    cache = KVCache(WINDOW)
    with torch.no_grad():
        full = model(idx)                                          # (2, 11, V)
        assert torch.equal(model(idx, cache=KVCache(WINDOW)), full)  # prefill: the same kernel
        parts = [model(idx[:, a:b], cache=cache) for a, b in ((0, 4), (4, 7), (7, 8), (8, 11))]
        torch.testing.assert_close(torch.cat(parts, 1), full, rtol=0, atol=1e-5)
        assert cache.length == 11
        with pytest.raises(ValueError, match="recompute"):         # past the position table
            model(idx[:, :6], cache=cache)


@pytest.mark.parametrize("name", ["gpt", "hf:gpt2", "hf:llama"])
@pytest.mark.parametrize("temperature, top_k", [(0.0, 0), (1.0, 5)])
def test_cache_equals_no_cache_past_the_window(name, temperature, top_k):
    model = _model(name)
    prompt, n = [3, 1, 4, 1, 5], 3 * WINDOW                      # ends far past the window
    fed = _fed_lengths(model)
    want = sample_batch(model, [prompt], n, WINDOW, temperature, top_k, 7, cache=False)
    assert fed == [min(len(prompt) + i, WINDOW) for i in range(n)]
    fed.clear()
    got = sample_batch(model, [prompt], n, WINDOW, temperature, top_k, 7, cache=True)
    assert got == want
    # the cache at work: the prompt once, then one token a step until the window is full,
    # then the whole window each step (positions move: module doc of decode.py)
    expected = [len(prompt)] + [1 if len(prompt) + i <= WINDOW else WINDOW for i in range(1, n)]
    assert fed == expected
    assert len(set(want[0])) > 1                                   # not a constant stream


@pytest.mark.parametrize("name", ["gpt", "hf:llama"])
def test_a_batch_equals_each_prompt_alone(name):
    model = _model(name)
    rows = [[1, 2, 3], [9, 8, 7], [5, 5, 5]]
    batch = sample_batch(model, rows, 20, WINDOW, 0.0, 0, 0)
    assert batch == [sample_batch(model, [r], 20, WINDOW, 0.0, 0, 0, cache=False)[0]
                     for r in rows]


def test_sample_many_keeps_the_order_across_lengths():
    model = _model("gpt")
    prompts = [[1, 2, 3], [4], [5, 6, 7], [8, 9]]
    got = generate.sample_many(model, prompts, 10, WINDOW, 0.0, 0, 0)
    assert got == [generate.sample(model, p, 10, WINDOW, 0.0, 0, 0, cache=False)
                   for p in prompts]


def test_a_model_without_a_cache_recomputes_the_window():
    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = _model("gpt")

        def forward(self, idx):
            return self.inner(idx)
    model = Plain()
    assert Decoder(model, WINDOW).kind is None
    fed = _fed_lengths(model)
    sample_batch(model, [[1, 2]], 4, WINDOW, 0.0, 0, 0)
    assert fed == [2, 3, 4, 5]


# -- the command ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("gencache")
    (root / "corpus.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    assert cli.main(["train", "--model", "gpt", "--n-layer", "1", "--n-embd", "32", "--n-head",
                     "2", "--block-size", "16", "--dataset", "text", "--data-path",
                     str(root / "corpus.txt"), "--token-cache", str(root / "cache"),
                     "--strategy", "single", "--steps", "4", "--batch-size", "4", "--lr",
                     "1e-2", "--device", "cpu", "--out-dir", str(root), "--run-name", "r",
                     "--no-progress", "--eval-every", "0"]) == 0
    return root


def test_prompts_file_gives_one_line_per_prompt(run, capsys):
    prompts = ["the quick", "the lazy", "fox", "the quack"]        # two of one length: a batch
    path = run / "prompts.txt"
    path.write_text("\n".join(prompts) + "\n")
    folder = str(run / "r")
    args = ["generate", "--run", folder, "--prompts-file", str(path), "--max-new-tokens", "24",
            "--temperature", "0"]
    assert cli.main(args) == 0
    out = capsys.readouterr()
    lines = [json.loads(line) for line in out.out.splitlines()]
    want = [generate.generate_many(folder, [p], 24, temperature=0, cache=False)["continuations"][0]
            for p in prompts]
    assert lines == [{"prompt": p, "continuation": c} for p, c in zip(prompts, want)]
    assert "tokens/s" in out.err and f"generated {24 * len(prompts)} tokens" in out.err
    assert "KV cache on" in out.err
    assert cli.main(args + ["--no-cache"]) == 0                     # the flag: the same text
    again = capsys.readouterr()
    assert again.out == out.out and "KV cache off" in again.err
    # one prompt on the command line: the text as before, equal to the file's first line
    assert cli.main(["generate", "--run", folder, "--prompt", prompts[0], "--max-new-tokens",
                     "24", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == prompts[0] + want[0] + "\n"


@pytest.mark.parametrize("content, says", [
    (None, "no such file"),
    (b"\xff\xfe bad\n", "is not UTF-8"),
    (b"", "holds no prompt"),
    (b"the quick\n\nfox\n", "line 2 = '': encodes to no token"),
    (b"fox\n" + b"x" * 17 + b"\n", "line 2 = '17 tokens': longer than the model's window"),
])
def test_bad_prompts_file_is_one_line(run, capsys, content, says):
    path = run / "bad.txt"
    path.unlink(missing_ok=True)
    if content is not None:
        path.write_bytes(content)
    code = cli.main(["generate", "--run", str(run / "r"), "--prompts-file", str(path)])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "--prompts-file" in err and says in err, err


def test_prompt_and_prompts_file_together_are_refused(run, capsys):
    try:
        code = cli.main(["generate", "--run", str(run / "r"), "--prompt", "x",
                         "--prompts-file", str(run / "corpus.txt")])
    except SystemExit as exc:
        code = exc.code
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "not allowed with" in err, err


def test_speed_benchmark_writes_its_result(tmp_path):
    """The benchmark's JSON (tiny sizes: no timing is asserted, only what it records)."""
    from shardwise.bench import generate_speed
    assert generate_speed.main(["--out", str(tmp_path), "--n-layer", "1", "--n-embd", "32",
                                "--n-head", "2", "--block-size", "24", "--prompt-len", "4",
                                "--new-tokens", "30", "--repeats", "1"]) == 0
    result = json.loads((tmp_path / generate_speed.RESULT).read_text())
    assert result["same_tokens"] is True and result["new_tokens"] == 30
    assert {"commit", "dirty", "date"} <= set(result["machine"])
    assert result["speedup"] == round(result["no_cache"]["median_s"] /
                                      result["cache"]["median_s"], 2)
