"""Next-token logits one step at a time, with a key-value cache: shardwise's GPT
(models/gpt.py's ``KVCache``) and Hugging Face models (their own cache: ``use_cache=True`` and
``cache`` / ``past_key_values``); any other model recomputes its window at each step.

With the cache, the first step runs the whole prompt and keeps every block's keys and values;
each later step runs only the newest token against them: a step costs O(1) tokens of weights
instead of O(window). Without it (``cache=False``, or a model of neither kind) each step runs
the last ``window`` tokens, the reference the cache must equal.

The window. Our GPT and GPT-2 learn absolute positions 0..block_size-1, and the reference shows
the model the last ``window`` tokens at positions 0..window-1. Once the sequence is longer than
the window, every token's position moves by one at each step, so no stored key stays valid: from
then on each step recomputes the window exactly as the reference does (the cache is dropped).
Llama's rotary positions would let a cache roll (only distances matter), but the rolled scores
equal the reference's only up to rounding, so Llama takes the same exact path.
"""
from __future__ import annotations

import inspect
import sys

import torch

from shardwise.models.build import logits_of
from shardwise.models.gpt import GPT, KVCache


def cache_kind(model: torch.nn.Module) -> str | None:
    """'gpt' (our KVCache), 'hf' (a transformers model's own cache) or None (no cache)."""
    if isinstance(model, GPT):
        return "gpt"
    transformers = sys.modules.get("transformers")     # an HF model means it is imported
    if transformers is not None and isinstance(model, transformers.PreTrainedModel):
        return "hf"
    return None


class Decoder:
    """``next_logits(idx)``: the logits (B, V) that follow ``idx`` (B, T), the whole sequence so
    far, which grows by one token per call (the batch's rows share one length)."""

    def __init__(self, model: torch.nn.Module, window: int, cache: bool = True):
        self.model, self.window = model, window
        self.kind = cache_kind(model) if cache else None
        self.state = None          # KVCache or the HF cache; None before the first step
        self.seen = 0              # tokens the cache holds
        # the HF cache's keyword and output field: ``cache`` from transformers 5.2x (which
        # still takes ``past_key_values`` with a deprecation warning), before that the latter
        self.hf_key = ("cache" if self.kind == "hf" and "cache" in
                       inspect.signature(model.forward).parameters else "past_key_values")

    def next_logits(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if self.kind is None or T > self.window:       # the reference: the last window tokens
            self.state = None                          # positions move from now on (module doc)
            return logits_of(self.model(idx[:, -self.window:]))[:, -1]    # (B, V)
        new = idx[:, self.seen:]                       # the prompt first, then one token
        if self.kind == "gpt":
            if self.state is None:
                self.state = KVCache(self.window)
            logits = self.model(new, cache=self.state)
        else:
            out = self.model(input_ids=new, use_cache=True, **{self.hf_key: self.state})
            logits, self.state = out.logits, out[self.hf_key]
        self.seen = T
        return logits[:, -1]                           # (B, V)


def pick(logits: torch.Tensor, temperature: float, top_k: int, g: torch.Generator) -> int:
    """One token from one row of CPU logits (V,): the most likely at temperature 0, else drawn
    from softmax(logits / T) over the ``top_k`` most likely (0: all) with ``g``."""
    if temperature == 0:
        return int(logits.argmax())
    logits = logits / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    return int(torch.multinomial(torch.softmax(logits, -1), 1, generator=g))


def sample_batch(model, rows: list[list[int]], n: int, window: int, temperature: float,
                 top_k: int, seed: int, cache: bool = True) -> list[list[int]]:
    """``n`` tokens after each of ``rows`` (prompts of one length, decoded as one batch), on the
    model's device; each row picks its tokens on the CPU with its own generator seeded with
    ``seed``, so a row continues as it would alone."""
    device = next(model.parameters()).device
    gens = [torch.Generator().manual_seed(seed) for _ in rows]       # CPU: one stream anywhere
    idx = torch.tensor(rows, dtype=torch.long, device=device)        # (B, T)
    decoder = Decoder(model, window, cache)
    new: list[list[int]] = [[] for _ in rows]
    with torch.no_grad():
        for _ in range(n):
            logits = decoder.next_logits(idx).float().cpu()          # (B, V)
            nxt = [pick(logits[b], temperature, top_k, g) for b, g in enumerate(gens)]
            for b, t in enumerate(nxt):
                new[b].append(t)
            idx = torch.cat([idx, torch.tensor(nxt, device=device).view(-1, 1)], dim=1)
    return new
