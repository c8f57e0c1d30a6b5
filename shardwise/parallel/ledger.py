"""What a strategy's memory ledger measures while it trains: saved activations, and the
transient bytes live at the one instant their sum peaks. A mixin of base.Strategy.

Saved activations. During the first ``ACT_SAMPLES`` training forwards (a loop's shapes repeat,
and the hook costs Python time per saved tensor) every tensor autograd saves for backward is
wrapped in a small holder: the holder counts its storage's bytes the first time the storage is
saved (parameters, and views of them, are left out: they are not activations), and its
``__del__`` uncounts them when autograd frees the last holder of that storage, which happens as
backward passes the node that saved it. So ``_act_live`` is the bytes of saved activations alive
now, exactly, forward and backward; ``activations_peak`` (the ledger's category) is its largest
value.

The peak instant. The ledger's categories are each their own high-water mark, and the transient
ones peak at different moments: saved activations at the end of forward, communication buffers
(ZeRO's gradient staging, gathered units, the backend's copies) in backward and after the step.
Adding the marks over-reads. So every change of a transient (an activation saved, a buffer
accounted by ZeRO's ZeroMemory.alloc) also checks whether activations + transient buffers alive *now*
exceed the largest such sum so far, and keeps that instant's split. ``memory_at_peak()`` is the
ledger with the transient categories replaced by their values at that instant: what the rank
held at its peak, which shardwise/bench/memory.py compares with the measured peak resident memory.
Gradients that come and go within a step (ZeRO-2/3 free their shards after the step and
allocate each at its first reduce-scatter) are sampled the same way. The persistent categories
(parameters, DDP's and ZeRO-1's gradient buckets, optimizer states, masters) are read at the end; from the second step on they hold through every instant, and the sampled forwards
include steps 2 and 3. The instant is tracked only while the sampled forwards and their
backwards and steps run (the hot path pays nothing afterwards).
"""
from __future__ import annotations

import contextlib

import torch

ACT_SAMPLES = 3        # training forwards whose saved activations the ledger measures


class _Saved:
    """One saved tensor, holding its storage in the live count until autograd drops it."""
    __slots__ = ("t", "key", "book")

    def __init__(self, t: torch.Tensor, key: int, book: "ActivationLedger"):
        self.t, self.key, self.book = t, key, book

    def __del__(self):
        self.book._unsave(self.key)


class ActivationLedger:
    """Live saved-activation bytes and the peak instant (module docstring)."""

    def _init_activation_ledger(self) -> None:
        self._act_peak = 0                # largest live saved-activation bytes
        self._act_live = 0                # saved-activation bytes alive now
        self._act_refs: dict[int, list[int]] = {}   # storage -> [bytes, holders]
        self._act_samples = 0
        self._instant = {"total": 0, "activations_peak": 0, "comm_buffers": 0}

    # -- saved activations ----------------------------------------------------------------
    @contextlib.contextmanager
    def _measure_activations(self):
        """Wrap a training forward: count what autograd saves (first ``ACT_SAMPLES`` only)."""
        self._act_samples += 1
        if self._act_samples > ACT_SAMPLES:
            yield
            return
        weights = {p.untyped_storage()._cdata for p in self.model.parameters()}

        def pack(t):
            key = t.untyped_storage()._cdata
            if key in weights:
                return t
            ref = self._act_refs.get(key)
            if ref is None:
                ref = self._act_refs[key] = [t.untyped_storage().nbytes(), 0]
                self._act_live += ref[0]
                self._act_peak = max(self._act_peak, self._act_live)
                self._note_instant()
            ref[1] += 1
            return _Saved(t, key, self)

        def unpack(saved):
            return saved.t if isinstance(saved, _Saved) else saved
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield

    def _unsave(self, key: int) -> None:
        ref = self._act_refs.get(key)
        if ref is None:
            return
        ref[1] -= 1
        if ref[1] == 0:
            self._act_live -= ref[0]
            del self._act_refs[key]

    # -- the peak instant ---------------------------------------------------------------
    def _transient_live(self) -> int:
        """Communication buffers alive now that the ledger counts as transient (ZeRO: its ZeroMemory)."""
        return 0

    def _grads_live(self) -> int | None:
        """Gradient bytes alive now when they come and go within a step (ZeRO-2/3's shards live
        from their first reduce-scatter to the step); None when they persist."""
        return None

    def _note_instant(self) -> None:
        if self._act_samples > ACT_SAMPLES:
            return                        # sampling is over: later steps repeat the same shapes
        comm, grads = self._transient_live(), self._grads_live()
        total = self._act_live + comm + (grads or 0)
        if total > self._instant["total"]:
            self._instant = {"total": total, "activations_peak": self._act_live,
                             "comm_buffers": comm, "gradients": grads}

    def memory_at_peak(self) -> dict[str, int]:
        """The ledger at the instant activations + transient buffers peaked together (module
        docstring): persistent categories as ``memory_ledger()``, the transient ones sampled."""
        ledger = dict(self.memory_ledger())
        ledger["activations_peak"] = self._instant["activations_peak"]
        if self._transients_sampled():
            ledger["comm_buffers"] = self._instant["comm_buffers"]
        if self._instant.get("gradients") is not None:
            ledger["gradients"] = self._instant["gradients"]
        return ledger

    def _transients_sampled(self) -> bool:
        """Whether ``comm_buffers`` is transient and tracked by ``_transient_live`` (ZeRO) rather
        than a persistent buffer (DDP's compression copies)."""
        return False
