"""``shardwise generate --run DIR --prompt "..." --max-new-tokens N``: sample from a trained model.

Everything comes from the run directory ``DIR`` that ``shardwise train`` wrote:
  * the model: ``config.json`` (the resolved config) builds it again (``gpt``, ``hf:gpt2``,
    ``hf:llama``), in one process, on ``--device`` (``auto``: CUDA when present, else the CPU;
    ``cpu``; ``cuda``, refused without a visible GPU); without ``--device``, the run's own
    ``train.device``. The model and the tokens live there; each step's logits come back to
    the CPU to pick the next token;
  * the weights: ``final.safetensors`` (the plain model after the last step, written by
    shardwise/train.py in every layout), else the latest checkpoint of the run's
    ``--checkpoint-dir``, exported to the plain state dict (shardwise/checkpoint/tools.py; any
    layout, resharded);
  * the tokenizer: ``bytes`` (the default and ``--dataset stdlib``), or the run directory's copy
    of the BPE / tokenizer file it trained with.
Sampling: autoregressive, one token at a time, the context cut to the model's last
``block_size`` tokens; ``--temperature 0`` takes the most likely token (greedy), otherwise
softmax(logits / T) restricted to the ``--top-k`` most likely (0: all), drawn from a CPU
generator seeded with ``--seed`` (the same text for the same seed; on another device the logits
may differ in the last bits, and so, rarely, may a token). The prompt and the continuation are
printed to stdout; which weights were used goes to stderr. Bad input is refused with one line
(exit 2): a missing run directory, no weights, an empty prompt, a prompt longer than the window
or with tokens outside the model's vocabulary.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from shardwise.config import ConfigError

FINAL = "final.safetensors"           # shardwise/train.py's FINAL_WEIGHTS (no torch import here)
MODELS = ("gpt", "hf:gpt2", "hf:llama")
DEVICES = ("auto", "cpu", "cuda")     # train.device's choices


def parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap = parser_class(prog="shardwise generate", description=(
        "Sample text from a model 'shardwise train' trained (its run directory)."))
    ap.add_argument("--run", required=True, help="the run directory (out_dir/run_name)")
    ap.add_argument("--prompt", required=True, help="the text to continue")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="softmax temperature; 0 = greedy (default 1.0)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="sample among the k most likely tokens; 0 = all (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--device", choices=DEVICES, default=None,
                    help="where the model runs: auto = cuda when present, else cpu "
                         "(default: the run's train.device)")
    return ap


def check_args(args: argparse.Namespace) -> None:
    if args.max_new_tokens < 1:
        raise ConfigError("--max-new-tokens", args.max_new_tokens, "must be at least 1",
                          "give the number of tokens to add, e.g. --max-new-tokens 50")
    if not args.temperature >= 0 or args.temperature == float("inf"):
        raise ConfigError("--temperature", args.temperature, "must be a finite number >= 0",
                          "use 1.0 for plain sampling, 0 for greedy")
    if args.top_k < 0:
        raise ConfigError("--top-k", args.top_k, "must be >= 0", "use 0 for all tokens")


def pick_device(choice: str):
    """The torch device for ``--device`` (``auto``: CUDA when present); a device passes through.
    Touches CUDA only when the answer is CUDA."""
    import torch
    if isinstance(choice, torch.device):
        return choice
    if choice not in DEVICES:
        raise ConfigError("--device", choice, "is not a device generate knows",
                          f"use one of {', '.join(DEVICES)}")
    if choice == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device", choice, "no CUDA device is visible",
                          "use --device cpu (or auto)")
    if choice == "cuda" or (choice == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def load_run(folder: str):
    """The run's resolved Config; refused when the folder or its config.json is missing, or
    the model is not a language model generate knows."""
    from shardwise.config import from_dict
    from shardwise.rundir import CONFIG_FILE
    if not os.path.isdir(folder):
        raise ConfigError("--run", folder, "is not a directory", "give a run directory "
                          "'shardwise train' wrote (<out_dir>/<run_name>, printed at its end)")
    path = os.path.join(folder, CONFIG_FILE)
    if not os.path.isfile(path):
        raise ConfigError("--run", folder, f"holds no {CONFIG_FILE}", "give a run directory "
                          "'shardwise train' wrote (<out_dir>/<run_name>)")
    try:
        with open(path, encoding="utf-8") as fh:
            cfg = from_dict(json.load(fh))
    except (OSError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError("--run", folder, f"its {CONFIG_FILE} cannot be read ({exc})",
                          "give a run directory 'shardwise train' wrote") from None
    if cfg.model.name not in MODELS:
        raise ConfigError("model.name", cfg.model.name, "is not a language model generate "
                          "can sample from", f"train one of {', '.join(MODELS)}")
    if cfg.memory.lora_rank > 0:
        raise ConfigError("memory.lora_rank", cfg.memory.lora_rank, "the run trained LoRA "
                          "adapters, which the plain model does not have", "merge them first "
                          "(shardwise.memory.lora.merge_lora), or train without --lora-rank")
    return cfg


def tokenizer(cfg, folder: str):
    """The run's tokenizer (shardwise/data/tokenize.py), from the run directory's copy."""
    from shardwise.data import tokenize
    d = cfg.data
    if d.dataset == "stdlib" or (d.dataset == "text" and d.tokenizer == "bytes"):
        return tokenize.ByteTokenizer()
    if d.dataset != "text":
        raise ConfigError("data.dataset", d.dataset, "the run trained on tokens without a "
                          "tokenizer, so a prompt cannot be read", "train on --dataset text "
                          "or stdlib")
    kind, arg = tokenize.parse_spec(d.tokenizer)
    candidates = [folder]                       # the copy: tokenizer.json (or vocab + merges)
    if kind == "path":
        if os.path.isfile(arg):
            candidates.insert(0, os.path.join(folder, os.path.basename(arg)))
        candidates.append(arg)                  # the original, where the run read it
    for path in candidates:
        try:
            return tokenize.load(path)
        except FileNotFoundError:
            continue
    raise ConfigError("--run", folder, f"holds no copy of the run's tokenizer ({d.tokenizer})",
                      "put the tokenizer.json the run trained with into the run directory")


def weights(cfg, folder: str):
    """(plain state dict, where it came from): final.safetensors, else the latest checkpoint."""
    from safetensors.torch import load_file
    final = os.path.join(folder, FINAL)
    if os.path.isfile(final):
        return load_file(final), final
    root = cfg.train.checkpoint_dir
    if root:
        from shardwise.checkpoint import store, tools
        if store.resolve(root) is not None:
            with tempfile.TemporaryDirectory() as tmp:
                out = os.path.join(tmp, "model.safetensors")
                import warnings
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")     # DCP's "no process group" notice
                    tools.export(root, out)
                return load_file(out), f"checkpoint {tools.find(root)}"
    raise ConfigError("--run", folder, f"holds no weights: no {FINAL} (the run did not finish)"
                      " and no checkpoint in its --checkpoint-dir "
                      f"({root or 'none was set'})", "let the run finish, or train with "
                      "--checkpoint-dir and generate from its checkpoints")


def build(cfg, state: dict, device="cpu"):
    """The run's model with ``state`` loaded, on ``device``; every parameter must be in it,
    nothing more."""
    import torch
    from shardwise.models import build_model
    model = build_model(cfg.model, cfg.train.seed)
    names = {n for n, _ in model.named_parameters()}     # tied weights: once, as saved
    known = set(model.state_dict())
    missing, extra = sorted(names - set(state)), sorted(set(state) - known)
    if missing or extra:
        raise ConfigError("--run", "weights", f"do not fit the run's model ({len(missing)} "
                          f"missing, e.g. {missing[:2]}; {len(extra)} unexpected, e.g. "
                          f"{extra[:2]})", "use the run directory the weights were trained in")
    with torch.no_grad():
        model.load_state_dict(state, strict=False)
    return model.to(device).eval()


def encode_prompt(tok, prompt: str, cfg) -> list[int]:
    ids = tok.encode(prompt)
    vocab, window = cfg.model.vocab_size, cfg.model.block_size
    if not ids:
        raise ConfigError("--prompt", prompt, "encodes to no token", "give some text")
    bad = sorted({i for i in ids if not 0 <= i < vocab})
    if bad:
        raise ConfigError("--prompt", prompt if len(prompt) <= 40 else prompt[:37] + "...",
                          f"has tokens outside the model's vocabulary of {vocab} ({bad[:3]})",
                          "use text the run's tokenizer covers with the model's vocabulary")
    if len(ids) > window:
        raise ConfigError("--prompt", f"{len(ids)} tokens", f"longer than the model's window "
                          f"(block_size {window})", f"give at most {window} tokens of prompt")
    return ids


def sample(model, ids: list[int], n: int, window: int, temperature: float, top_k: int,
           seed: int) -> list[int]:
    """``n`` tokens after ``ids``: greedy (temperature 0) or sampled (see the module), on the
    model's device; the choice of each token is made on the CPU."""
    import torch
    from shardwise.models import logits_of
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)                       # CPU: one stream everywhere
    idx = torch.tensor([ids], dtype=torch.long, device=device)    # (1, T)
    new = []
    with torch.no_grad():
        for _ in range(n):
            logits = logits_of(model(idx[:, -window:]))[0, -1].float().cpu()   # (V,)
            if temperature == 0:
                nxt = int(logits.argmax())
            else:
                logits = logits / temperature
                if 0 < top_k < logits.numel():
                    kth = torch.topk(logits, top_k).values[-1]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))
            new.append(nxt)
            idx = torch.cat([idx, torch.tensor([[nxt]], device=device)], dim=1)
    return new


def generate(folder: str, prompt: str, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, device=None) -> tuple[str, str]:
    """(prompt + generated text, where the weights came from). ``device``: auto | cpu | cuda
    or a torch.device; None: the run's ``train.device``."""
    cfg = load_run(folder)
    where = pick_device(cfg.train.device if device is None else device)
    tok = tokenizer(cfg, folder)
    ids = encode_prompt(tok, prompt, cfg)
    state, source = weights(cfg, folder)
    model = build(cfg, state, where)
    new = sample(model, ids, max_new_tokens, cfg.model.block_size, temperature, top_k, seed)
    return tok.decode(ids + new), source


def main(argv: list[str], parser_class=argparse.ArgumentParser, error=None) -> int:
    """The command; ``error(line) -> exit code`` prints a refusal (shardwise/cli.py's)."""
    args = parser(parser_class).parse_args(argv)
    try:
        check_args(args)
        text, source = generate(args.run, args.prompt, args.max_new_tokens, args.temperature,
                                args.top_k, args.seed, args.device)
    except ConfigError as exc:
        if error is not None:
            return error(str(exc))
        print("error: " + str(exc).replace("\n", "\\n"), file=sys.stderr)
        return 2
    print(f"weights: {source}", file=sys.stderr, flush=True)
    print(text, flush=True)
    return 0
