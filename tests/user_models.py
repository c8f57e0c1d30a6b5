"""Models shardwise did not write, and the single-process references they are compared with.

- ``gpt2(seed)``: a Hugging Face GPT2LMHeadModel from a small GPT2Config (never a download):
  2 layers, width 32, 4 heads, vocabulary 67, 16 positions, dropout 0, tied embedding and head.
  It returns a ModelOutput (a dict); ``gpt2_loss`` reads ``out.logits``.
- ``two_groups``: the AdamW factory with two parameter groups people write (decay on matrices,
  none on biases and norms).
- ``BNNet`` and ``bn_reference``: a small BatchNorm CNN, and what DDP / ps training of it must
  equal: each shard normalised with its own batch statistics, gradients averaged, and the
  running statistics those of rank (worker) 0's shard only, as torch DDP's broadcast_buffers
  gives (plain BatchNorm, not SyncBatchNorm).
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ = 67, 16


def gpt2(seed: int) -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=True,
                     bos_token_id=0, eos_token_id=0)
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(cfg)
    assert model.lm_head.weight is model.transformer.wte.weight   # tied
    return model


def gpt2_loss(out, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(out.logits.flatten(0, 1), y.flatten())


def token_batches(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randint(0, VOCAB, (batch, SEQ), generator=g)
        yield x, torch.roll(x, -1, dims=1)


def freeze(model: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Freeze the named parameters; return copies of their values."""
    params = dict(model.named_parameters())
    for n in names:
        params[n].requires_grad_(False)
    return {n: params[n].detach().clone() for n in names}


def two_groups(lr: float = 1e-2):
    def make(params):
        return torch.optim.AdamW([
            {"params": [p for p in params if p.ndim >= 2], "weight_decay": 0.1},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}], lr=lr)
    return make


def plain_run(model, factory, batches, loss_fn, max_norm: float = 0.0):
    """Single-process training on whole batches; (losses, norms before clipping, params)."""
    opt = factory([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if max_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(float(loss.detach()))
    return losses, norms, {k: v.detach().clone() for k, v in model.named_parameters()}


# -- BatchNorm ------------------------------------------------------------------------------
class BNNet(nn.Module):
    """conv -> BatchNorm -> ReLU -> linear on 1x6x6 images, 3 classes. The conv has no bias, as
    usual before a BatchNorm: the norm removes it, so its gradient is analytically zero and its
    computed one rounding noise, which Adam would turn into updates of up to lr."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.head(F.relu(self.bn(self.conv(x))).flatten(1))


def bn_net(seed: int) -> BNNet:
    torch.manual_seed(seed)
    return BNNet()


def image_batches(steps: int, batch: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        yield torch.randn(batch, 1, 6, 6, generator=g), torch.randint(0, 3, (batch,), generator=g)


def bn_reference(model: nn.Module, factory, batches, shards: int, max_norm: float = 0.0):
    """DDP on ``shards`` ranks, simulated in one process: per step, every shard's forward runs
    from the same buffers (rank 0's), the loss is the mean of the shards' mean losses (equal
    shards), the gradient their mean, and the buffers afterwards are those rank 0's forward
    left. Returns (losses, params, buffers, norms before clipping)."""
    opt = factory([p for p in model.parameters() if p.requires_grad])
    losses, norms = [], []
    for x, y in batches:
        opt.zero_grad()
        start = {k: v.clone() for k, v in model.named_buffers()}
        after_rank0, total = None, 0.0
        for r, (xs, ys) in enumerate(zip(x.chunk(shards), y.chunk(shards))):
            model.load_state_dict(start, strict=False)
            loss = F.cross_entropy(model(xs), ys)
            (loss / shards).backward()
            total += float(loss.detach()) / shards
            if r == 0:
                after_rank0 = {k: v.clone() for k, v in model.named_buffers()}
        model.load_state_dict(after_rank0, strict=False)
        if max_norm > 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)))
        opt.step()
        losses.append(total)
    return (losses, {k: v.detach().clone() for k, v in model.named_parameters()},
            {k: v.clone() for k, v in model.named_buffers()}, norms)


class UserNet(nn.Module):
    """A model shardwise did not write, with a branch that is unused on odd steps."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
        self.extra = nn.Linear(10, 3)
        self.use_extra = True

    def forward(self, x):
        out = self.body(x)
        return out + self.extra(x) if self.use_extra else out


class RowBranchLM(nn.Module):
    """A language model shardwise did not write whose ``extra`` layer runs only on the rows
    whose first token is a multiple of 4 (row by row, so a batch's result does not depend on
    how its rows are split): a rank, or a replica group, whose rows hold no such row gives
    ``extra`` no gradient while another one does (``--find-unused``)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.extra = nn.Linear(width, width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        h = self.emb(x)
        rows = (x[:, 0] % 4 == 0).nonzero().squeeze(1)
        if rows.numel():
            h = h.index_add(0, rows, self.extra(h.index_select(0, rows)))
        return self.head(h)


def row_branch_lm(cfg) -> RowBranchLM:
    """``--model user_models:row_branch_lm``: the run's vocabulary and width."""
    return RowBranchLM(cfg.vocab_size, cfg.n_embd)


class BatchNormLM(nn.Module):
    """A language model shardwise did not write with a BatchNorm over its embedding features:
    running statistics (buffers) that each rank updates from its own rows, and that evaluation
    reads (DDP takes data-parallel rank 0's at every forward, as torch DDP does)."""

    def __init__(self, vocab: int, width: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.norm = nn.BatchNorm1d(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, x):
        h = self.emb(x)
        h = self.norm(h.reshape(-1, h.shape[-1])).reshape(h.shape)
        return self.head(h)


def batchnorm_lm(cfg) -> BatchNormLM:
    """``--model user_models:batchnorm_lm``: the run's vocabulary and width."""
    return BatchNormLM(cfg.vocab_size, cfg.n_embd)
