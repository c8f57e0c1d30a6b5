"""ZeRO's state: the gathered full state dict (every parameter by name, fp32) and the per-rank
checkpoint (this rank's master shards, optimizer state, loss scale, buffers and frozen
parameters). A mixin of :class:`~shardwise.parallel.data.zero_base.ZeroBase`; it reads the chunks,
the optimizer and the store the strategy built.

Collectives: ``full_state_dict`` all-gathers each chunk's fp32 master (meter ``zero_state_ag``);
the per-rank checkpoint communicates nothing on save and, on load, stages 1-2 all-gather the
loaded shards back into whole parameters (``zero_param_ag``).
"""
from __future__ import annotations

import torch


class ZeroStateMixin:
    """full_state_dict / state_dict / load_state_dict for ZeRO stages 1-3."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter by name, in fp32, gathered from the masters (a collective); frozen
        parameters, which every rank holds whole, as they are (fp32)."""
        names = {p: n for n, p in self.model.named_parameters()}
        out = {}
        for c in self.chunks:
            full = torch.empty(c.layout.padded, dtype=torch.float32, device=c.master.device)
            self._all_gather(full, c.master.detach(), async_op=False, name="zero_state_ag")
            for p, view in zip(c.params, c.layout.views(full)):
                out[names[p]] = view.detach().cpu().clone()
        for n, p in self.model.named_parameters():
            if n not in out:
                out[n] = p.detach().float().cpu().clone()
        return self._whole({n: out[n] for n, _ in self.model.named_parameters()})

    def state_dict(self) -> dict:
        """This rank's shards: masters and the optimizer (a per-rank file), plus the buffers and
        frozen parameters every rank holds alike."""
        return {"stage": self.stage, "rank": self.group.rank, "world": self.group.size,
                "masters": [c.master.detach().cpu().clone() for c in self.chunks],
                "optimizer": self.optimizer.state_dict(), "scale": self.scaler.state_dict(),
                "buffers": {n: b.detach().cpu().clone() for n, b in self.model.named_buffers()},
                "frozen": {n: p.detach().cpu().clone() for n, p in self.model.named_parameters()
                           if not p.requires_grad}}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        if (state["stage"], state["world"]) != (self.stage, self.group.size):
            raise ValueError(f"checkpoint of ZeRO-{state['stage']} at dp={state['world']} cannot "
                             f"load into ZeRO-{self.stage} at dp={self.group.size}; fix: load "
                             "the gathered full_state_dict instead")
        for c, m in zip(self.chunks, state["masters"]):
            c.master.copy_(m)
            c.shard.copy_(c.master)
        self.optimizer.load_state_dict(state["optimizer"])
        for c in self.chunks:
            for _, _, _, view in c.masters:
                self.store.adopt_state(self.optimizer.state.get(view, {}))
            self._after_chunk_step(self.chunks.index(c))
        self._finish_gathers()
        if isinstance(state.get("scale"), dict):
            self.scaler.load_state_dict(state["scale"])
        buffers = dict(self.model.named_buffers())
        for n, b in state.get("buffers", {}).items():
            buffers[n].copy_(b)
        params = dict(self.model.named_parameters())
        for n, p in state.get("frozen", {}).items():
            params[n].copy_(p)

    def _finish_gathers(self) -> None:
        """Stages 1-2 wait for the all-gathers started in _after_chunk_step."""
