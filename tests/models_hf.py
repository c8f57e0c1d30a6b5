"""Models we did not write, built small and random (never downloaded), for equivalence tests:
a Hugging Face GPT-2 (tied lm_head / wte, dict-like ModelOutput), a Hugging Face Llama (RMSNorm,
rotary, grouped-query attention), a Hugging Face Mixtral (a routed mixture of experts) and a
BatchNorm CNN (buffers, float inputs). Shared by the
data-parallel and model-parallel test files.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 67, 16


def tiny_gpt2(seed: int, **overrides) -> nn.Module:
    """GPT2LMHeadModel: 2 layers, width 32, 4 heads, vocabulary 67, 16 positions, no dropout,
    weights tied (lm_head.weight is transformer.wte.weight), random init from ``seed``."""
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                     bos_token_id=0, eos_token_id=0, **overrides)
    torch.manual_seed(seed)
    return GPT2LMHeadModel(cfg)


def tiny_llama(seed: int, **overrides) -> nn.Module:
    """LlamaForCausalLM: 2 layers, width 32, 4 heads over 2 key-value heads (grouped-query
    attention), MLP 96, vocabulary 67, 16 positions, untied head, random init from ``seed``."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=96, vocab_size=VOCAB, max_position_embeddings=SEQ,
               use_cache=False, tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**cfg, **overrides}))


def tiny_mixtral(seed: int, **overrides) -> nn.Module:
    """MixtralForCausalLM: 2 layers, width 32, 4 heads over 2 key-value heads, a sparse
    mixture of 4 experts (MLP 48) of which each token takes 2 (a learned router: the
    ``mlp.gate``; the experts' weights are 3-D, one slice per expert), vocabulary 67, untied
    head, random init from ``seed``. ``output_router_logits=True`` adds the router's
    load-balancing loss to the model's own loss (``router_aux_loss_coef``)."""
    from transformers import MixtralConfig, MixtralForCausalLM
    from transformers.utils import logging
    logging.set_verbosity_error()
    cfg = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=48, num_local_experts=4, num_experts_per_tok=2,
               vocab_size=VOCAB, max_position_embeddings=SEQ, use_cache=False,
               tie_word_embeddings=False, attention_dropout=0.0)
    torch.manual_seed(seed)
    return MixtralForCausalLM(MixtralConfig(**{**cfg, **overrides}))


def lm_loss(out, y: torch.Tensor) -> torch.Tensor:
    """Next-token cross-entropy on a ModelOutput read like a dict (``out["logits"]``)."""
    logits = out["logits"]                                   # (B, T, V)
    return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())


def token_batches(steps: int, batch: int, seed: int = 1) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Random (x, y) token batches of shape (batch, SEQ), y = x shifted by one."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, VOCAB, (batch, SEQ + 1), generator=g)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


# tokens per row, each row padded (a row of L tokens after padding has L next-token labels); each
# aligned pair of rows holds 26 labels, so every micro-batch or shard of 2, 4 or 8 rows has the same
# count and the mean of their means is the whole batch's mean (the model's loss averages over them)
LENGTHS = (15, 11, 13, 13, 11, 15, 12, 14)


def padded_batches(steps: int, seed: int = 3, labels: bool = True) -> list[dict]:
    """Left-padded dict batches of len(LENGTHS) rows, as a tokenizer pads for a decoder:
    input_ids, attention_mask (0 on the padding), position_ids counting from each row's first
    token (both matter: with left padding a model that ignored them would see other positions
    and attend to padding), and labels (-100 on the padding) unless ``labels`` is False."""
    g = torch.Generator().manual_seed(seed)
    rows, out = len(LENGTHS), []
    mask = (torch.arange(SEQ)[None, :] >= SEQ - torch.tensor(LENGTHS)[:, None]).long()
    pos = (mask.cumsum(1) - 1).clamp(min=0)
    for _ in range(steps):
        ids = torch.randint(1, VOCAB, (rows, SEQ), generator=g).masked_fill(mask == 0, 0)
        batch = {"input_ids": ids, "attention_mask": mask.clone(), "position_ids": pos.clone()}
        if labels:
            batch["labels"] = ids.masked_fill(mask == 0, -100)
        out.append(batch)
    return out


def one_process_loop(model: nn.Module, lr: float, max_norm: float, steps: int, batch: int) -> dict:
    """The reference a layout must equal: ``model`` on the whole batch of token_batches, AdamW
    with two_groups, the next-token loss on its logits, torch's own clipping at ``max_norm``."""
    opt = two_groups(lr)(list(model.parameters()))
    losses, norms = [], []
    for x, y in token_batches(steps, batch):
        out = model(x)
        logits = out if torch.is_tensor(out) else out["logits"]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return dict(losses=losses, norms=norms,
                params={n: p.detach().clone() for n, p in model.named_parameters()})


def two_groups(lr: float = 1e-2):
    """An AdamW factory with two parameter groups: matrices decay (0.1), vectors do not."""
    def make(params):
        params = list(params)
        return torch.optim.AdamW([
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)
    return make


class BNNet(nn.Module):
    """Two conv + BatchNorm layers and a linear head on (B, 1, 8, 8) float images, 3 classes."""

    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1), nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:     # (B, 1, 8, 8) -> (B, 3)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)   # (B, 4, 4, 4)
        return self.head(x.flatten(1))


def image_batches(steps: int, batch: int, seed: int = 2):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(batch, 1, 8, 8, generator=g), torch.randint(0, 3, (batch,), generator=g))
            for _ in range(steps)]
