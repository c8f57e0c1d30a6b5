"""GradBuckets between steps: gradients dropped (None) and copied into the buckets by the next
backward, never accumulated onto stale values; a parameter that got none reads zero."""
import torch
import torch.nn as nn

from shardwise.comm.buckets import GradBuckets


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))


def _plain_grads(model, x, skip_last=False):
    ref = _model()
    ref.load_state_dict(model.state_dict())
    out = ref[:2](x) if skip_last else ref(x)
    out.square().sum().backward()
    return [p.grad if p.grad is not None else torch.zeros_like(p) for p in ref.parameters()]


def test_cleared_gradients_are_copied_in_fresh_and_unused_ones_read_zero():
    model = _model()
    ready = []
    buckets = GradBuckets(list(model.named_parameters()), 64, ready.append)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)

    buckets.reattach(lazy=True)
    buckets.reset()
    model(x1).square().sum().backward()
    for p, view, g in zip(model.parameters(), buckets.views, _plain_grads(model, x1)):
        assert p.grad is view
        torch.testing.assert_close(view, g)
    assert len(ready) == len(buckets.buckets)

    buckets.clear()                               # a step's end: every .grad None, views kept
    assert all(p.grad is None for p in model.parameters())
    stale = [b.buffer.clone() for b in buckets.buckets]
    buckets.reattach(lazy=True)                   # before a forward: nothing zeroed
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(b.buffer, s) for b, s in zip(buckets.buckets, stale))

    buckets.reset()
    model[:2](x2).square().sum().backward()       # the last layer gets no gradient
    buckets.reattach()                            # before the reduction: its views zeroed
    for p, view, g in zip(model.parameters(), buckets.views,
                          _plain_grads(model, x2, skip_last=True)):
        assert p.grad is view
        torch.testing.assert_close(view, g)       # this backward's gradient, not stale + new


def test_accumulation_after_a_clear_adds_in_place():
    model = _model()
    buckets = GradBuckets(list(model.named_parameters()), 0, lambda b: None)
    x1, x2 = torch.randn(4, 6), torch.randn(4, 6)
    buckets.reattach(lazy=True)
    buckets.clear()
    for x in (x1, x2):                            # two micro-batches, no step between
        buckets.reset()
        model(x).square().sum().backward()
    want = [a + b for a, b in zip(_plain_grads(model, x1), _plain_grads(model, x2))]
    for view, g in zip(buckets.views, want):
        torch.testing.assert_close(view, g)
