"""A strategy's state for checkpoints: a mixin of base.Strategy.

``state_dict`` / ``load_state_dict``: this rank's own state (model + optimizer as the layout
holds them), reloaded only in the same layout and world (shardwise/checkpoint/ stores it per
rank). ``full_state_dict``: every parameter by its original name, gathered whole.
``canonical_optimizer_state`` / ``load_canonical_optimizer_state``: the optimizer state per
parameter name, whole, the layout-free form that lets a checkpoint load into another layout
(shardwise/checkpoint/canonical.py). Layouts that shard differently (ZeRO, the parameter server,
the pipeline) override these.
"""
from __future__ import annotations

import torch


class StrategyState:
    """Checkpoint state of the plain and tensor-parallel layouts (module docstring)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, by its original name, on CPU (tensor-parallel
        pieces gathered: a collective over tp)."""
        return self._whole({k: v.detach().cpu().clone() for k, v in self.model.named_parameters()})

    def _whole(self, state: dict) -> dict:
        """Gather the tensor-parallel pieces of a by-name state (identity without tp)."""
        return state if self.plan is None else self.plan.gather(state, self.device)

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])

    # -- the layout-free optimizer state (shardwise/checkpoint/: reshard) --------------------
    def canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """The optimizer's per-parameter state by the parameter's original name, on CPU, whole:
        element-wise states (Adam's exp_avg / exp_avg_sq, SGD's momentum_buffer) shaped like
        the full parameter (tensor-parallel pieces gathered: a collective over tp, in
        named_parameters order on every tp rank), scalars (Adam's step) as they are. Any
        layout's :meth:`load_canonical_optimizer_state` takes it. Memory: a CPU copy of the
        whole optimizer state (one gathered parameter at a time on the device)."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for name, p in self.model.named_parameters():
            state = self.optimizer.state.get(p, {})
            entry = {}
            for key, v in sorted(state.items()):
                if not torch.is_tensor(v):
                    continue
                if v.dim() > 0 and self.plan is not None and name in self.plan.specs:
                    v = self.plan.gather({name: v}, self.device)[name]
                entry[key] = v.detach().cpu().clone()
            if entry:
                out[name] = entry
        return out

    def load_canonical_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        """Set the optimizer's per-parameter state from :meth:`canonical_optimizer_state`'s
        form (whole tensors by original name; this rank keeps its tensor-parallel piece)."""
        self._load_canonical_into(self.model, self.optimizer, state)

    @torch.no_grad()
    def _load_canonical_into(self, model, optimizer, state: dict) -> None:
        """:meth:`load_canonical_optimizer_state` for one (model, optimizer) pair."""
        for name, p in model.named_parameters():
            if name not in state:
                continue
            entry = {}
            for key, v in state[name].items():
                v = self._tp_piece(name, v)
                if v.dim() > 0:
                    v = v.to(p.device, p.dtype if v.is_floating_point() else v.dtype)
                entry[key] = v.clone()
            optimizer.state[p] = entry

    def _tp_piece(self, name: str, whole: torch.Tensor) -> torch.Tensor:
        """This rank's tensor-parallel piece of a whole per-parameter tensor (itself when the
        parameter is not split, or for a scalar)."""
        if whole.dim() == 0 or self.plan is None:
            return whole
        return self.plan.piece(name, whole)


class PipelineState:
    """The layout-free optimizer state of the pipeline layout (parallel/hybrid.py, pp > 1): a
    mixin placed before the pipeline's ZeRO-1 and base.Strategy.

    Save: each stage builds its own layers' states under their single-model names, whole over
    tp and dp (stage 0 of data parallel, the DDP component: its own canonical state, renamed;
    flat ZeRO-1: each group's flat state all-gathered over dp, cut into parameters, tp pieces
    gathered), then the stages' dicts are merged (one object all-gather over pp).
    Load: each stage keeps its layers' entries, this tp rank's piece and (ZeRO-1) this dp rank's
    slice of each group's flat state: no communication."""

    def canonical_optimizer_state(self) -> dict[str, dict[str, torch.Tensor]]:
        if self.dp is not None:
            own = {self._full_name(n): v for n, v in self.dp.canonical_optimizer_state().items()}
        else:
            own = self._zero1_canonical()
        merged: dict[str, dict[str, torch.Tensor]] = {}
        for part in self.comm.all_gather_object(own, self.mesh.pp_group):
            merged.update(part)
        return merged

    def _zero1_canonical(self) -> dict[str, dict[str, torch.Tensor]]:
        """This stage's ZeRO-1 state by single-model name, whole (collectives over dp, tp;
        ``self.tp_plan``: the tensor-parallel split by single-model name, hybrid.py's)."""
        names = {id(q): self._full_name(n) for n, q in self.model.named_parameters()}
        out: dict[str, dict[str, torch.Tensor]] = {}
        for f, m in zip(self.flats, self.masters):
            for key, v in sorted(self.optimizer.state.get(m, {}).items()):
                if not torch.is_tensor(v):
                    continue
                if v.dim() == 0:                 # Adam's step: the same for every member
                    for q in f.members:
                        out.setdefault(names[id(q)], {})[key] = v.detach().cpu().clone()
                    continue
                full = torch.empty(f.layout.padded, dtype=v.dtype, device=v.device)
                self.comm.all_gather(full, v.detach().contiguous(), self.mesh.dp_group,
                                     name="gather_state")
                for q, view in zip(f.members, f.layout.views(full)):
                    name = names[id(q)]
                    view = self.tp_plan.gather({name: view.detach().cpu()}, view.device)[name]
                    out.setdefault(name, {})[key] = view.clone()
        return out

    @torch.no_grad()
    def load_canonical_optimizer_state(self, state: dict[str, dict[str, torch.Tensor]]) -> None:
        if self.dp is not None:
            local = {n: state[self._full_name(n)] for n, _ in self.dp.model.named_parameters()
                     if self._full_name(n) in state}
            self.dp.load_canonical_optimizer_state(local)
            return
        names = {id(q): self._full_name(n) for n, q in self.model.named_parameters()}
        for f, m in zip(self.flats, self.masters):
            present = [state.get(names[id(q)], {}) for q in f.members]
            entry = {}
            for key in sorted({k for e in present for k in e}):
                pieces = []
                for q, e in zip(f.members, present):
                    v, name = e.get(key), names[id(q)]
                    if v is None:
                        v = torch.zeros(q.shape)
                    elif v.dim() > 0:
                        v = self.tp_plan.piece(name, v)
                    pieces.append(v)
                if pieces[0].dim() == 0:
                    entry[key] = pieces[0].clone()
                    continue
                flat = f.layout.new_flat(pieces, m.dtype, m.device)
                entry[key] = f.shard(flat, self.mesh.dp_rank).clone()
            self.optimizer.state[m] = entry
