"""A strategy's state for checkpoints: a mixin of base.Strategy.

``state_dict`` / ``load_state_dict``: this rank's own state (model + optimizer as the layout
holds them), reloaded only in the same layout and world (shardwise/checkpoint/ stores it per
rank). ``full_state_dict``: every parameter by its original name, gathered whole.
``canonical_optimizer_state`` / ``load_canonical_optimizer_state``: the optimizer state per
parameter name, whole, the layout-free form that lets a checkpoint load into another layout
(shardwise/checkpoint/canonical.py). Layouts that shard differently (ZeRO, the parameter server)
override these; the pipeline driver renames its component's and merges them over the stages.
"""
from __future__ import annotations

import torch


class StrategyState:
    """Checkpoint state of the plain and tensor-parallel layouts (module docstring)."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter of the whole model, by its original name, on CPU (tensor-parallel
        pieces gathered: a collective over tp)."""
        return self._whole({k: v.detach().cpu().clone() for k, v in self.model.named_parameters()})

    def full_state_order(self) -> list[tuple[str, tuple[int, ...]]] | None:
        """(name, whole shape) of every parameter, in the order :meth:`full_state_groups`
        yields them (``named_parameters``'): the streamed final.safetensors
        (shardwise/run/train._save_final) writes in this order."""
        return [(n, self.whole_shape(n, p)) for n, p in self.model.named_parameters()]

    def full_state_groups(self):
        """:meth:`full_state_dict` one parameter at a time, fp32 on the CPU (a collective under
        tensor parallelism: every rank iterates it to the end, in the same order, and gathers
        each split parameter from the tp group). Memory: one whole parameter at a time, never
        a second copy of the model (a tp rank never holds the whole model)."""
        for n, p in self.model.named_parameters():
            yield {k: v.float() for k, v in self._whole({n: p.detach().cpu().clone()}).items()}

    def whole_shape(self, name: str, p: torch.Tensor) -> tuple[int, ...]:
        """The shape of parameter ``name`` in the whole model (its tp piece's, with the split
        dimension at its full size)."""
        shape = list(p.shape)
        spec = None if self.plan is None else self.plan.specs.get(name)
        if spec is not None:
            shape[spec.dim] = spec.full * spec.parts
        return tuple(shape)

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
