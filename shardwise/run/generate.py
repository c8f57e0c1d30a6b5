"""``shardwise generate --run DIR --prompt "..." --max-new-tokens N``: sample from a trained model
(or ``--prompts-file FILE``: one prompt per line, one continuation each).

Everything comes from the run directory ``DIR`` that ``shardwise train`` wrote:
  * the model: ``config.json`` (the resolved config) builds it again (``gpt``, ``hf:gpt2``,
    ``hf:llama``), in one process, on ``--device`` (``auto``: CUDA when present, else the CPU;
    ``cpu``; ``cuda``, refused without a visible GPU); without ``--device``, the run's own
    ``train.device``. The model and the tokens live there; each step's logits come back to
    the CPU to pick the next token;
  * the weights: ``final.safetensors`` (the plain model after the last step, written by
    shardwise/run/train.py in every layout), else the latest checkpoint of the run's
    ``--checkpoint-dir``, exported to the plain state dict (shardwise/checkpoint/tools.py; any
    layout, resharded);
  * the tokenizer: ``bytes`` (the default and ``--dataset stdlib``), or the run directory's copy
    of the BPE / tokenizer file it trained with.
Sampling: autoregressive, one token at a time, the context cut to the model's last
``block_size`` tokens, with a key-value cache (our GPT's, or a Hugging Face model's own): the
prompt runs once, then each step runs only the newest token; once the sequence outgrows the
window each step recomputes it (shardwise/models/decode.py says why); ``--no-cache`` recomputes
the window at every step, the reference the cache equals. ``--temperature 0`` takes the most
likely token (greedy), otherwise softmax(logits / T) restricted to the ``--top-k`` most
likely (0: all), drawn from a CPU generator seeded with ``--seed`` (the same text for the
same seed; on another device the logits may differ in the last bits, and so, rarely, may a
token). The prompt and the continuation are
printed to stdout; which weights were used, and the tokens generated per second, go to stderr.
With ``--prompts-file`` each line is a prompt; prompts of one token length are decoded as one
batch, each row sampled as if alone (its own generator seeded with ``--seed``), and stdout gets
one JSON line per prompt, in order: ``{"prompt": ..., "continuation": ...}`` (a continuation may
hold newlines). Bad input is refused with one line (exit 2): a missing run directory, no
weights, an empty prompt, a prompt longer than the window or with tokens outside the model's
vocabulary, a prompts file that is missing, not UTF-8 or empty, or one bad line (named).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

from shardwise.config import ConfigError

FINAL = "final.safetensors"           # shardwise/run/train.py's FINAL_WEIGHTS (no torch import here)
MODELS = ("gpt", "hf:gpt2", "hf:llama")
DEVICES = ("auto", "cpu", "cuda")     # train.device's choices
BATCH_ROWS = 32                       # prompts of one length decoded together, at most


def parser(parser_class=argparse.ArgumentParser) -> argparse.ArgumentParser:
    ap = parser_class(prog="shardwise generate", description=(
        "Sample text from a model 'shardwise train' trained (its run directory)."))
    ap.add_argument("--run", required=True, help="the run directory (out_dir/run_name)")
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="the text to continue")
    which.add_argument("--prompts-file", metavar="FILE", help="a UTF-8 text file, one prompt "
                       "per line; prints one JSON line {prompt, continuation} per prompt")
    ap.add_argument("--max-new-tokens", type=int, default=100, help="tokens to add (default 100)")
    ap.add_argument("--temperature", type=float, default=1.0,
                    help="softmax temperature; 0 = greedy (default 1.0)")
    ap.add_argument("--top-k", type=int, default=0,
                    help="sample among the k most likely tokens; 0 = all (default 0)")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    ap.add_argument("--device", choices=DEVICES, default=None,
                    help="where the model runs: auto = cuda when present, else cpu "
                         "(default: the run's train.device)")
    ap.add_argument("--no-cache", action="store_true",
                    help="recompute the whole window for every token instead of keeping the "
                         "keys and values (slower; the same tokens)")
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
    from shardwise.config.rundir import CONFIG_FILE
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


def encode_prompt(tok, prompt: str, cfg, field: str = "--prompt") -> list[int]:
    ids = tok.encode(prompt)
    vocab, window = cfg.model.vocab_size, cfg.model.block_size
    if not ids:
        raise ConfigError(field, prompt, "encodes to no token", "give some text")
    bad = sorted({i for i in ids if not 0 <= i < vocab})
    if bad:
        raise ConfigError(field, prompt if len(prompt) <= 40 else prompt[:37] + "...",
                          f"has tokens outside the model's vocabulary of {vocab} ({bad[:3]})",
                          "use text the run's tokenizer covers with the model's vocabulary")
    if len(ids) > window:
        raise ConfigError(field, f"{len(ids)} tokens", f"longer than the model's window "
                          f"(block_size {window})", f"give at most {window} tokens of prompt")
    return ids


def read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts-file``: one per line (a blank line is refused by
    encode_prompt, named by its number)."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError("--prompts-file", path, "no such file", "give a text file with one "
                          "prompt per line") from None
    except UnicodeDecodeError as exc:
        raise ConfigError("--prompts-file", path, f"is not UTF-8 text ({exc.reason} at byte "
                          f"{exc.start})", "save the prompts as UTF-8, one per line") from None
    except OSError as exc:
        raise ConfigError("--prompts-file", path, f"cannot be read ({exc.strerror})",
                          "give a readable text file with one prompt per line") from None
    prompts = text.splitlines()
    if not prompts:
        raise ConfigError("--prompts-file", path, "holds no prompt", "write one prompt per line")
    return prompts


def sample(model, ids: list[int], n: int, window: int, temperature: float, top_k: int,
           seed: int, cache: bool = True) -> list[int]:
    """``n`` tokens after ``ids``: greedy (temperature 0) or sampled (see the module), on the
    model's device, with the KV cache unless ``cache`` is False; each token is chosen on the
    CPU."""
    from shardwise.models.decode import sample_batch
    return sample_batch(model, [ids], n, window, temperature, top_k, seed, cache)[0]


def sample_many(model, prompts: list[list[int]], n: int, window: int, temperature: float,
                top_k: int, seed: int, cache: bool = True) -> list[list[int]]:
    """``sample`` for each prompt, in order: prompts of one length go as one batch (at most
    BATCH_ROWS rows), each row sampled as if alone."""
    from shardwise.models.decode import sample_batch
    by_length: dict[int, list[int]] = {}
    for i, ids in enumerate(prompts):
        by_length.setdefault(len(ids), []).append(i)
    out: list[list[int]] = [[] for _ in prompts]
    for rows in by_length.values():
        for at in range(0, len(rows), BATCH_ROWS):
            chunk = rows[at:at + BATCH_ROWS]
            new = sample_batch(model, [prompts[i] for i in chunk], n, window, temperature,
                               top_k, seed, cache)
            for i, tokens in zip(chunk, new):
                out[i] = tokens
    return out


def generate_many(folder: str, prompts: list[str], max_new_tokens: int,
                  temperature: float = 1.0, top_k: int = 0, seed: int = 0, device=None,
                  cache: bool = True, field: str = "--prompt") -> dict:
    """Continue each of ``prompts`` from the run in ``folder``: {"texts": prompt + generated
    text each, "continuations", "source": where the weights came from, "tokens": tokens
    generated, "seconds": the decoding's wall time, "device"}. ``device``: auto | cpu | cuda or
    a torch.device; None: the run's ``train.device``."""
    cfg = load_run(folder)
    where = pick_device(cfg.train.device if device is None else device)
    tok = tokenizer(cfg, folder)
    many = len(prompts) > 1 or field != "--prompt"
    ids = [encode_prompt(tok, p, cfg, f"{field} line {i + 1}" if many else field)
           for i, p in enumerate(prompts)]
    state, source = weights(cfg, folder)
    model = build(cfg, state, where)
    start = time.perf_counter()
    new = sample_many(model, ids, max_new_tokens, cfg.model.block_size, temperature, top_k,
                      seed, cache)
    seconds = time.perf_counter() - start
    return {"texts": [tok.decode(a + b) for a, b in zip(ids, new)],
            "continuations": [tok.decode(b) for b in new], "source": source,
            "tokens": sum(map(len, new)), "seconds": seconds, "device": str(where)}


def generate(folder: str, prompt: str, max_new_tokens: int, temperature: float = 1.0,
             top_k: int = 0, seed: int = 0, device=None, cache: bool = True) -> tuple[str, str]:
    """(prompt + generated text, where the weights came from): ``generate_many`` for one."""
    out = generate_many(folder, [prompt], max_new_tokens, temperature, top_k, seed, device, cache)
    return out["texts"][0], out["source"]


def main(argv: list[str], parser_class=argparse.ArgumentParser, error=None) -> int:
    """The command; ``error(line) -> exit code`` prints a refusal (shardwise/cli.py's)."""
    args = parser(parser_class).parse_args(argv)
    try:
        check_args(args)
        from_file = args.prompts_file is not None
        prompts = read_prompts(args.prompts_file) if from_file else [args.prompt]
        out = generate_many(args.run, prompts, args.max_new_tokens, args.temperature,
                            args.top_k, args.seed, args.device, not args.no_cache,
                            "--prompts-file" if from_file else "--prompt")
    except ConfigError as exc:
        if error is not None:
            return error(str(exc))
        print("error: " + str(exc).replace("\n", "\\n"), file=sys.stderr)
        return 2
    rate = out["tokens"] / max(out["seconds"], 1e-9)
    print(f"weights: {out['source']}", file=sys.stderr, flush=True)
    print(f"generated {out['tokens']} tokens for {len(prompts)} prompt(s) in "
          f"{out['seconds']:.2f} s: {rate:,.0f} tokens/s on {out['device']} (KV cache "
          f"{'off' if args.no_cache else 'on'})", file=sys.stderr, flush=True)
    if not from_file:
        print(out["texts"][0], flush=True)
        return 0
    for prompt, cont in zip(prompts, out["continuations"]):
        print(json.dumps({"prompt": prompt, "continuation": cont}, ensure_ascii=False),
              flush=True)
    return 0
