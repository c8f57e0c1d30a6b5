"""Freezing and LoRA, single process: what is frozen stays bit-identical and out of the optimizer;
LoRA starts equal to the base model, trains only its adapters, and merges back into a model with
the original state-dict names and the adapted model's outputs."""
import copy

import pytest
import torch

from models_hf import VOCAB, tiny_gpt2
from shardwise.memory.freeze import freeze, parse_patterns
from shardwise.memory.lora import LoRALinear, inject_lora, merge_lora, trainable_count
from shardwise.models.gpt import GPT, GPTConfig, lm_loss

CFG = GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=32)
RANK, ALPHA = 4, 8.0


def gpt(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return GPT(CFG)


def batches(steps: int, vocab: int, seq: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocab, (4, seq + 1), generator=g)   # (B, T + 1)
        out.append((tokens[:, :-1], tokens[:, 1:]))
    return out


def logits(model, x):
    out = model(x)
    return out if torch.is_tensor(out) else out["logits"]               # HF: a ModelOutput


def train(model, data, weight_decay: float = 0.1):
    """AdamW on the trainable parameters only; returns the optimizer."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                            lr=1e-2, weight_decay=weight_decay)
    for x, y in data:
        opt.zero_grad()
        lm_loss(logits(model, x), y).backward()
        opt.step()
    return opt


# ---------------------------------------------------------------- freeze

def test_parse_patterns_strips_and_drops_empties():
    assert parse_patterns(" blocks.0.* , ,tok_emb,") == ["blocks.0.*", "tok_emb"]
    assert parse_patterns("") == []


def test_freeze_block_glob_freezes_exactly_that_block():
    model = gpt()
    frozen = freeze(model, ["blocks.0.*"])
    expected = sorted(n for n, _ in model.named_parameters() if n.startswith("blocks.0."))
    assert frozen == expected and expected
    for n, p in model.named_parameters():
        assert p.requires_grad == (n not in expected), n


def test_freeze_accepts_module_and_parameter_names():
    for pattern in ("tok_emb", "tok_emb.weight", "tok_*"):
        model = gpt()
        assert freeze(model, pattern) == ["tok_emb.weight"]
        assert not model.tok_emb.weight.requires_grad
    assert freeze(gpt(), "*.bias") == sorted(n for n, _ in gpt().named_parameters()
                                              if n.endswith(".bias"))


def test_unknown_pattern_is_refused_and_freezes_nothing():
    model = gpt()
    with pytest.raises(ValueError, match=r"'block\.0\.attn'") as err:
        freeze(model, ["tok_emb", "block.0.attn"])
    msg = str(err.value)
    assert "\n" not in msg and "'blocks.0.attn'" in msg and "'tok_emb'" in msg
    assert all(p.requires_grad for p in model.parameters())   # checked before anything froze


def test_tied_parameter_is_frozen_once_and_reported_under_both_names():
    model = gpt()
    model.head.weight = model.tok_emb.weight                   # tie head to the embedding
    assert freeze(model, "head") == ["head.weight", "tok_emb.weight"]
    assert not model.tok_emb.weight.requires_grad
    total = sum(p.numel() for p in model.parameters())          # the tied matrix once
    assert trainable_count(model) == (total - model.tok_emb.weight.numel(), total)


def test_frozen_parameters_stay_bit_identical_and_hold_no_optimizer_state():
    model = gpt()
    frozen = freeze(model, "blocks.0.*,tok_emb")
    params = dict(model.named_parameters())
    before = {n: p.detach().clone() for n, p in params.items()}
    opt = train(model, batches(3, CFG.vocab_size, CFG.block_size), weight_decay=0.1)
    for n in frozen:
        # weight decay would shrink a frozen weight if the optimizer held it: it must not
        assert torch.equal(params[n], before[n]), n
        assert params[n].grad is None and params[n] not in opt.state, n
    moved = [n for n in params if n not in frozen and not torch.equal(params[n], before[n])]
    assert set(moved) == set(params) - set(frozen)              # everything else did train


# ---------------------------------------------------------------- LoRA

def expected_adapter_params(model, names) -> int:
    """r (in + out) per adapted layer, read from the original layers' weight shapes."""
    total = 0
    for n in names:
        w = model.get_submodule(n).weight        # Linear: (out, in); Conv1D: (in, out)
        total += RANK * (w.shape[0] + w.shape[1])
    return total


def check_lora_round_trip(model, targets, data, x):
    """Inject, train, merge; the checks every model gets."""
    original = copy.deepcopy(model)
    names = inject_lora(model, RANK, ALPHA, targets)
    assert names and all(isinstance(model.get_submodule(n), LoRALinear) for n in names)
    # B = 0 at init, so base(x) + 0: the adapted model is the base model bit for bit
    assert torch.equal(logits(model, x), logits(original, x))
    base_total = sum(p.numel() for p in original.parameters())
    adapters = expected_adapter_params(original, names)
    assert trainable_count(model) == (adapters, base_total + adapters)

    frozen = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    train(model, data)
    for n, p in model.named_parameters():
        if n in frozen:
            assert torch.equal(p, frozen[n]) and p.grad is None, n   # base weights untouched
    adapted = logits(model, x)
    assert not torch.allclose(adapted, logits(original, x))          # the adapters did train

    merge_lora(model)
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert list(model.state_dict()) == list(original.state_dict())
    # x (W + sBA)^T against x W^T + s (x A^T) B^T: the same sum rounded in another order (fp32,
    # a few ulps per matmul over two layers); 1e-5 relative is ~100 ulps, atol covers logits ~ 0
    torch.testing.assert_close(logits(model, x), adapted, rtol=1e-5, atol=1e-6)
    return original, names


def test_lora_on_our_gpt():
    data = batches(4, CFG.vocab_size, CFG.block_size)
    original, names = check_lora_round_trip(gpt(), "*attn.qkv,*mlp.fc", data, data[0][0])
    assert names == ["blocks.0.attn.qkv", "blocks.0.mlp.fc", "blocks.1.attn.qkv", "blocks.1.mlp.fc"]


def test_lora_on_hf_gpt2_conv1d():
    seq = 8
    data = batches(4, VOCAB, seq)
    model = tiny_gpt2(0)
    original, names = check_lora_round_trip(model, ["*attn.c_attn"], data, data[0][0])
    assert names == ["transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"]
    assert type(model.transformer.h[0].attn.c_attn).__name__ == "Conv1D"
    assert model.lm_head.weight is model.transformer.wte.weight      # the tie survived the merge


def test_lora_on_a_tied_head_unties_it_on_merge():
    """GPT-2's lm_head shares wte's weight: the adapter changes only the head's use of it."""
    data = batches(3, VOCAB, 8)
    model = tiny_gpt2(0)
    wte = model.transformer.wte.weight
    check_lora_round_trip(model, "lm_head", data, data[0][0])
    assert torch.equal(model.transformer.wte.weight, wte)              # embedding stayed frozen
    assert not torch.equal(model.lm_head.weight, wte)                 # head = W + s B A, its own


def test_lora_linear_matches_its_merged_weight_on_conv1d_and_linear():
    """Direct unit check with a nonzero B: both weight layouts merge to the same map."""
    from transformers.pytorch_utils import Conv1D
    torch.manual_seed(0)
    x = torch.randn(3, 5)                                             # (B, in)
    for base in (torch.nn.Linear(5, 7), Conv1D(7, 5)):
        lora = LoRALinear(base, rank=2, alpha=4.0)
        assert (lora.in_features, lora.out_features) == (5, 7) and lora.scale == 2.0
        with torch.no_grad():
            lora.lora_B.normal_()
        merged = lora.merged()
        assert type(merged) is type(base) and merged.weight.shape == base.weight.shape
        torch.testing.assert_close(merged(x), lora(x), rtol=1e-5, atol=1e-6)  # as above


def test_lora_errors_name_the_fix_and_leave_the_model_alone():
    model = gpt()
    with pytest.raises(ValueError, match="rank must be >= 1"):
        inject_lora(model, 0, ALPHA, ["*attn.qkv"])
    with pytest.raises(ValueError, match=r"'blocks\.0\.ln_1'.*LayerNorm"):
        inject_lora(model, RANK, ALPHA, ["*attn.qkv", "blocks.0.ln_1"])
    with pytest.raises(ValueError, match=r"'\*attn\.qkvv'.*'blocks\.0\.attn\.qkv'"):
        inject_lora(model, RANK, ALPHA, ["*attn.qkvv"])
    assert not any(isinstance(m, LoRALinear) for m in model.modules())
    assert all(p.requires_grad for p in model.parameters())
    inject_lora(model, RANK, ALPHA, ["*attn.qkv"])
    with pytest.raises(ValueError, match="already has LoRA"):
        inject_lora(model, RANK, ALPHA, ["blocks.0.attn.qkv"])
