"""8-bit AdamW: the dynamic maps, block-wise quantisation, parity with torch, groups, shards, state.

Where 8-bit states are lossless (all zero, or one magnitude per block, which codes as +-1 of the
block's scale) AdamW8bit must equal torch's AdamW bit for bit: it applies torch's formula term for
term. Elsewhere the error is the quantisation's, bounded from the maps."""
import inspect
import io
import math
import sys
import types

import pytest
import torch

from shardwise.memory import optim8bit
from shardwise.memory.optim8bit import (AdamW8bit, dequantize_blockwise, dynamic_map,
                                        make_adamw8bit, nearest_codes, quantize_blockwise,
                                        state_bytes)
from shardwise.models.gpt import GPT, GPTConfig, lm_loss

B = 2048  # the default block size


@pytest.mark.parametrize("signed", [True, False])
def test_dynamic_maps_are_256_sorted_codes_over_seven_decades(signed):
    qmap = dynamic_map(signed)
    assert qmap.shape == (256,) and qmap.dtype == torch.float32
    assert torch.all(qmap[1:] > qmap[:-1])                      # sorted, so unique
    assert qmap.max() == 1.0 and qmap.min() == (-1.0 if signed else 0.0) and 0.0 in qmap
    # decade e (values in (10^-(e+1), 10^-e]) has 2^f codes, f = 6 - e fraction bits signed
    # and one more unsigned; the factor 1.01 sits between a decade's top, 10^-e, and the next
    # decade's lowest code, 10^-e (1 + 9 / 2^f) >= 1.07 * 10^-e
    pos = qmap[qmap > 0].double()
    for e in range(7):
        f = 6 - e + (0 if signed else 1)
        in_decade = (pos > 1.01 * 10.0 ** -(e + 1)) & (pos <= 1.01 * 10.0 ** -e)
        assert int(in_decade.sum()) == 2**f
    assert pos.min() == pytest.approx(1e-7)                     # the one extra code
    assert not signed or torch.equal(-qmap[qmap < 0].flip(0), qmap[qmap > 1.5e-7])  # mirrored


@pytest.mark.parametrize("signed", [True, False])
def test_nearest_codes_equal_bucketize_over_midpoints(signed):
    qmap = dynamic_map(signed)
    mids = (qmap[1:] + qmap[:-1]) / 2
    x = torch.rand(200_000, generator=torch.Generator().manual_seed(0))
    x = x if not signed else 2 * x - 1
    # the codes, the midpoints, their float neighbours, signed zeros and tiny values
    edges = torch.cat([qmap, mids, torch.nextafter(mids, torch.ones(())),
                       torch.nextafter(mids, -torch.ones(()))])
    x = torch.cat([x, x ** 8, edges, torch.tensor([0.0, -0.0, 1e-30, -1e-30, 1e-9])])
    x = x.clamp(-1, 1) if signed else x.clamp(0, 1)
    assert torch.equal(nearest_codes(x[None], (signed,))[0].long(), torch.bucketize(x, mids))


@pytest.mark.parametrize("signed", [True, False])
def test_blockwise_round_trip_error_is_half_the_widest_code_gap(signed):
    n = 5 * B + 123                                             # a partial last block
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    x = x if signed else x.square()                             # second moments are squares
    x[:B] *= 1000                                               # one block of outliers
    codes, absmax = torch.empty(1, n, dtype=torch.uint8), torch.empty(1, 6)
    quantize_blockwise(x[None], (signed,), B, codes, absmax)
    y = dequantize_blockwise(codes, absmax, (signed,), B)[0]
    codes, absmax = codes[0], absmax[0]
    # each block has its own scale: the outliers do not coarsen the other blocks
    assert torch.equal(absmax, torch.stack([b.abs().max() for b in x.split(B)]))
    scale = absmax.repeat_interleave(B)[:n]
    # nearest code: the error is at most half the widest gap between neighbouring codes (0.9/128
    # signed, 0.9/256 unsigned) times the block's scale, plus 2^-22 of it for the two fp32
    # roundings (x / scale and code * scale)
    qmap = dynamic_map(signed)
    half_gap = float((qmap[1:] - qmap[:-1]).max()) / 2
    assert half_gap == pytest.approx(0.9 / (128 if signed else 256), rel=1e-5)   # fp32 codes
    assert torch.all((x - y).abs() <= scale * (half_gap + 2**-22))
    # and the code is the nearest one, to within an ulp (the midpoints are rounded to fp32)
    unit = x / scale
    best = (unit[:, None] - qmap[None, :]).abs().min(dim=1).values
    assert torch.all((unit - qmap[codes.long()]).abs() <= best + 2**-24)
    # dynamic, not linear: decade e of a block (|x| in (10^-(e+1), 10^-e] of its scale) has 2^f
    # codes, so the relative error there is <= (0.9 10^-e / 2^f / 2) / 10^-(e+1) = 4.5 / 2^f:
    # at e = 2, 28% signed (f = 4) and 14% unsigned (f = 5), where a linear map (steps of
    # scale / 127) would be off by up to 390%
    f = 4 if signed else 5
    small = (x.abs() > 1e-3 * scale) & (x.abs() <= 1e-2 * scale)
    assert small.sum() > 100
    assert torch.all((x - y).abs()[small] <= 4.5 / 2**f * x.abs()[small] + 2**-22 * scale[small])


def _two_groups():
    """Two linears in two groups (own lr, weight decay, betas) and one parameter left gradless."""
    torch.manual_seed(0)
    a, b, frozen = torch.nn.Linear(8, 16), torch.nn.Linear(16, 4), torch.nn.Parameter(torch.ones(3))
    groups = [dict(params=list(a.parameters()) + [frozen], lr=0.1, weight_decay=0.5),
              dict(params=list(b.parameters()), lr=0.01, weight_decay=0.0, betas=(0.8, 0.99))]
    return groups, frozen


def _params(groups):
    return [p for g in groups for p in g["params"]]


@pytest.mark.parametrize("sign_pattern", [False, True])
def test_lossless_states_track_torch_adamw_bit_for_bit_per_group(sign_pattern):
    (groups, frozen), (twin, _) = _two_groups(), _two_groups()          # equal copies
    ours = AdamW8bit(groups, betas=(0.9, 0.95))
    ref = torch.optim.AdamW(twin, betas=(0.9, 0.95), foreach=False)
    gen = torch.Generator().manual_seed(1)
    signs = [torch.randint(0, 2, p.shape, generator=gen) * 2.0 - 1 for p in _params(groups)]
    for _ in range(10):
        c = float(torch.rand((), generator=gen)) + 0.1          # one magnitude this step
        for p, q, s in zip(_params(groups), _params(twin), signs):
            if p is not frozen:
                # zeros: decay alone; +-c: every block holds one magnitude
                p.grad = (s * c) if sign_pattern else torch.zeros_like(p)
                q.grad = p.grad.clone()
        ours.step(), ref.step()
    assert all(torch.equal(p, q) for p, q in zip(_params(groups), _params(twin)))
    assert frozen not in ours.state and torch.equal(frozen, torch.ones(3))
    if not sign_pattern:
        # zero gradients: p_t = p_0 (1 - lr wd)^t in group 0 (lr 0.1, wd 0.5), p_0 in group 1
        initial, _ = _two_groups()
        expected = initial[0]["params"][0].detach().clone()
        for _ in range(10):
            expected.mul_(1 - 0.1 * 0.5)
        assert torch.equal(groups[0]["params"][0], expected)
        assert torch.equal(groups[1]["params"][0], initial[1]["params"][0])
        state = ours.state[groups[0]["params"][0]]
        assert not dequantize_blockwise(state["codes"], state["absmax"], (True, False), B).any()


def test_decoupled_false_is_torch_adams_l2_weight_decay():
    runs, makers = {}, {"adam8": lambda g: AdamW8bit(g, decoupled=False), "adamw8": AdamW8bit,
                        "torch_adam": lambda g: torch.optim.Adam(g, foreach=False)}
    for name, make in makers.items():
        groups, frozen = _two_groups()                          # the same initial weights each
        gen = torch.Generator().manual_seed(2)                  # and the same gradients
        for p in _params(groups):
            if p is not frozen:
                p.grad = torch.randn(p.shape, generator=gen)
        make(groups).step()
        runs[name] = _params(groups)
    # step 1 updates from this step's fp32 moments (the stored ones are zero): torch's exactly
    assert all(torch.equal(p, q) for p, q in zip(runs["adam8"], runs["torch_adam"]))
    # Adam's L2 term is not AdamW's decay where weight decay is set (group 0), same without it
    assert not torch.equal(runs["adam8"][0], runs["adamw8"][0])
    group1 = len(_two_groups()[0][0]["params"])
    assert all(torch.equal(p, q) for p, q in zip(runs["adam8"][group1:], runs["adamw8"][group1:]))


@pytest.mark.parametrize("bad", [dict(lr=-1.0), dict(eps=-1.0), dict(weight_decay=-0.1),
                                 dict(betas=(0.9, 1.0)), dict(block_size=0)])
def test_bad_arguments_are_refused_by_name(bad):
    with pytest.raises(ValueError, match=next(iter(bad))):
        AdamW8bit([torch.nn.Parameter(torch.zeros(3))], **bad)


def test_flat_shard_of_5000_values_keeps_three_8bit_blocks():
    flat = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(3)))
    twin = flat.detach().clone().requires_grad_()
    ours = AdamW8bit([flat], lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.1, foreach=False)
    flat.grad = torch.randn(5000, generator=torch.Generator().manual_seed(4))
    twin.grad = flat.grad.clone()
    ours.step(), ref.step()
    assert torch.equal(flat, twin)                              # step 1: torch's result
    state, exact = ours.state[flat], ref.state[twin]
    # rows: m (exp_avg) in the signed map, v (exp_avg_sq) in the unsigned one
    assert state["codes"].dtype == torch.uint8 and state["codes"].shape == (2, 5000)
    assert state["absmax"].dtype == torch.float32
    assert state["absmax"].shape == (2, 3)                      # blocks 2048 + 2048 + 904
    got = dequantize_blockwise(state["codes"], state["absmax"], (True, False), B)
    for row, (key, signed) in enumerate((("exp_avg", True), ("exp_avg_sq", False))):
        absmax = state["absmax"][row]
        # each block's scale is the absmax of torch's exact moment over that block
        assert torch.equal(absmax, torch.stack([b.abs().max() for b in exact[key].split(B)]))
        half_gap = float(dynamic_map(signed).diff().max()) / 2
        assert torch.all((got[row] - exact[key]).abs()
                         <= absmax.repeat_interleave(B)[:5000] * (half_gap + 2**-22))
    # two codes per value, two fp32 scales per block, a 4-byte step
    assert state_bytes(ours) == 2 * 5000 + 2 * 3 * 4 + 4


def _steps(params, opt, seed, steps):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.dtype)
        opt.step()


def test_chunked_update_equals_whole_tensor_update(monkeypatch):
    runs = []
    for chunk in (optim8bit.CHUNK_ELEMENTS, B):                 # one chunk, then one block a time
        monkeypatch.setattr(optim8bit, "CHUNK_ELEMENTS", chunk)
        flat = torch.nn.Parameter(torch.randn(5000, generator=torch.Generator().manual_seed(5)))
        opt = AdamW8bit([flat], lr=1e-2, weight_decay=0.1)
        _steps([flat], opt, seed=6, steps=4)
        runs.append((flat.detach().clone(), opt.state[flat]))
    (p1, s1), (p2, s2) = runs
    assert torch.equal(p1, p2) and all(torch.equal(s1[k], s2[k]) for k in s1)


def test_state_dict_round_trip_continues_bit_for_bit():
    def fresh():
        gen = torch.Generator().manual_seed(7)
        return [torch.nn.Parameter(torch.randn(300, generator=gen)),
                torch.nn.Parameter(torch.randn(5000, generator=gen).bfloat16())]   # bf16 too

    def optimizer(params):
        return AdamW8bit([dict(params=params[:1], lr=1e-2), dict(params=params[1:], lr=3e-3)],
                         weight_decay=0.1, betas=(0.9, 0.95))

    params = fresh()
    opt = optimizer(params)
    _steps(params, opt, seed=8, steps=5)
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in params], "opt": opt.state_dict()}, buffer)
    _steps(params, opt, seed=9, steps=1)                        # the uninterrupted run

    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = fresh()
    with torch.no_grad():
        for p, s in zip(resumed, saved["params"]):
            p.copy_(s)
    opt2 = optimizer(resumed)
    opt2.load_state_dict(saved["opt"])
    # torch's loader would cast codes to the parameter's dtype (4x their size) and scales to
    # bf16 (rounded); AdamW8bit.load_state_dict keeps them as saved
    assert all(opt2.state[p]["codes"].dtype == torch.uint8 for p in resumed)
    assert all(opt2.state[p]["absmax"].dtype == torch.float32 for p in resumed)
    _steps(resumed, opt2, seed=9, steps=1)
    for p, q in zip(params, resumed):
        assert torch.equal(p, q) and all(torch.equal(opt.state[p][k], opt2.state[q][k])
                                         for k in opt.state[p])
    assert state_bytes(opt2) == state_bytes(opt)


def test_make_adamw8bit_is_always_ours(monkeypatch):
    # bitsandbytes importable: still ours (same state keys on every device; issue 31);
    # tests/gpu_path/test_optim8bit_choice.py pretends CUDA too
    fake = types.SimpleNamespace(optim=types.SimpleNamespace(AdamW8bit=lambda p, **kw: ("bnb", kw)))
    monkeypatch.setitem(sys.modules, "bitsandbytes", fake)
    params = [torch.nn.Parameter(torch.zeros(3))]
    assert isinstance(make_adamw8bit(iter(params), lr=1e-2), AdamW8bit)
    assert isinstance(make_adamw8bit(params, decoupled=False), AdamW8bit)
    assert isinstance(make_adamw8bit(params, block_size=256), AdamW8bit)


def _train_gpt(make_optimizer, steps=200, batch=8):
    """(losses, optimizer) of a small GPT trained on the bytes of inspect.py (real Python text).

    Small for the time budget (2 layers x 32 wide, 43k parameters, batch 8 x 32), and chosen so:
    its loss ratio 8-bit / fp32 at step 200 stayed within 0.7% of 1 over 6 seeds, where twice as
    wide it spread to 4% and with one layer to 2.3%, both ways round: the spread is mostly the
    two trajectories drifting apart, which the 2% bound must not mistake for a bias.
    """
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_embd=32, n_head=4, block_size=32, vocab_size=256)
    model = GPT(cfg)
    optimizer, text, losses = make_optimizer(model.parameters()), _text(), []
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        starts = torch.randint(len(text) - cfg.block_size - 1, (batch, 1), generator=gen)
        tokens = text[starts + torch.arange(cfg.block_size + 1)]          # (batch, T + 1)
        loss = lm_loss(model(tokens[:, :-1]), tokens[:, 1:])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses, optimizer


def _text() -> torch.Tensor:
    with open(inspect.__file__, "rb") as f:
        return torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()    # (bytes,)


def test_gpt_trains_like_fp32_adamw_on_a_quarter_of_the_state():
    kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)
    fp32_losses, fp32 = _train_gpt(lambda ps: torch.optim.AdamW(ps, foreach=False, **kw))
    int8_losses, int8 = _train_gpt(lambda ps: AdamW8bit(ps, **kw))
    final_fp32, final_int8 = sum(fp32_losses[-10:]) / 10, sum(int8_losses[-10:]) / 10
    assert int8_losses[0] == fp32_losses[0]                     # same model, same first batch
    # both learned more than byte frequencies: below the text's unigram entropy (3.09 nats)
    freq = torch.bincount(_text(), minlength=256).double() / len(_text())
    unigram = float(-(freq[freq > 0] * freq[freq > 0].log()).sum())
    assert final_fp32 < unigram and final_int8 < unigram
    assert abs(final_int8 - final_fp32) <= 0.02 * final_fp32
    # states: 2 codes per value + 2 fp32 scales per block vs 2 fp32 moments; a step each
    params = [p for g in int8.param_groups for p in g["params"]]
    values, blocks = sum(p.numel() for p in params), sum(math.ceil(p.numel() / B) for p in params)
    assert state_bytes(int8) == 2 * values + 8 * blocks + 4 * len(params)
    assert state_bytes(fp32) == 8 * values + 4 * len(params)
    assert state_bytes(int8) <= 0.3 * state_bytes(fp32)
