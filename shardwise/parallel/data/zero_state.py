"""ZeRO's state (stages 1-3), as functions of the strategy: the gathered full state dict (every
parameter by name, fp32), the per-rank checkpoint (this rank's master shards, optimizer state,
loss scale, buffers and frozen parameters) and the layout-free optimizer state. The strategy's
state methods (base.Strategy's interface, which shardwise/checkpoint/ and the pipeline driver
call) each call one of these; they read the chunks, the optimizer and the store it built.

Partition: each rank saves and loads its own shards (``state_dict``); the gathered forms are
whole on every rank. Collectives: ``full_state_dict`` / ``full_state_groups`` /
``canonical_optimizer_state`` all-gather each chunk's fp32 master or state over the shard group
(meter ``zero_state_ag``; one object collective to agree on state names), except that under
tensor parallelism ``full_state_groups`` goes a parameter at a time in one order every rank
shares (an all-reduce of its bits over the shard group, then its tp all-gather:
:func:`_tp_groups`, which says why that cannot deadlock); the per-rank
checkpoint communicates nothing on save and, on load, stages 1-2 all-gather the loaded shards
back into whole parameters (``zero_param_ag``). Memory: one whole chunk (per state) at a time on
the device (``full_state_groups`` under tp: one parameter); the results on CPU. Traffic: (N-1)/N
of the fp32 chunk per gathered tensor.
"""
from __future__ import annotations

import torch


def full_state_dict(zero, pieces: bool = False, keep: bool = True) -> dict[str, torch.Tensor]:
    """Every parameter by name, in fp32, gathered from the masters (a collective); frozen
    parameters, which every rank holds whole, as they are (fp32). ``pieces``: this rank's
    tensor-parallel pieces, whole over the shard group only (no tp gather); ``keep`` False
    (with ``pieces``): take part in the gathers, keep nothing, return {} (a rank whose copy
    nobody reads holds one chunk at a time, not the model)."""
    zero.store.drain()                  # disk offload: every write finished (or raised)
    names = {p: n for n, p in zero.model.named_parameters()}
    out = {}
    for c in zero.chunks:
        # on the compute device: with offload the master is on CPU, and NCCL gathers only
        # device tensors (a no-op move on CPU)
        full = torch.empty(c.layout.padded, dtype=torch.float32, device=zero.device)
        zero._all_gather(full, c.master.detach().to(zero.device), async_op=False,
                         name="zero_state_ag")
        for p, view in zip(c.params, c.layout.views(full)):
            if keep:
                out[names[p]] = view.detach().cpu().clone()
        del full
    if not keep:
        return {}
    for n, p in zero.model.named_parameters():
        if n not in out:
            out[n] = p.detach().float().cpu().clone()
    out = {n: out[n] for n, _ in zero.model.named_parameters()}
    return out if pieces else zero._whole(out)


def full_state_order(zero) -> list[tuple[str, tuple[int, ...]]]:
    """(name, whole shape) of every parameter in the order :func:`full_state_groups` yields
    them: chunk by chunk, then the rest; under tensor parallelism ``named_parameters``' order
    (one parameter at a time: :func:`_tp_groups`), each split parameter's shape the whole one."""
    if getattr(zero, "plan", None) is not None:
        return [(n, zero.whole_shape(n, p)) for n, p in zero.model.named_parameters()]
    names = {p: n for n, p in zero.model.named_parameters()}
    order = [(names[p], tuple(p.shape)) for c in zero.chunks for p in c.params]
    seen = {n for n, _ in order}
    return order + [(n, tuple(p.shape)) for n, p in zero.model.named_parameters()
                    if n not in seen]


def full_state_groups(zero):
    """full_state_dict a chunk at a time, as fp32 CPU tensors by name (a collective: every
    rank iterates it to the end, in the same order): the memory of one gathered chunk, not
    of the whole model (a streamed final.safetensors). Under tensor parallelism a parameter
    at a time instead (:func:`_tp_groups`)."""
    if getattr(zero, "plan", None) is not None:
        yield from _tp_groups(zero)
        return
    zero.store.drain()
    names = {p: n for n, p in zero.model.named_parameters()}
    for c in zero.chunks:
        full = torch.empty(c.layout.padded, dtype=torch.float32, device=zero.device)
        zero._all_gather(full, c.master.detach().to(zero.device), async_op=False,
                         name="zero_state_ag")
        zero.store.release([c.master], written=False)   # disk: its pages read, dropped again
        yield {names[p]: view.detach().cpu().clone()
               for p, view in zip(c.params, c.layout.views(full))}
        del full
    done = {names[p] for c in zero.chunks for p in c.params}
    yield {n: p.detach().float().cpu().clone() for n, p in zero.model.named_parameters()
           if n not in done}


def _tp_groups(zero):
    """ZeRO under tensor parallelism, one whole parameter per group, in ``named_parameters``'
    order (the same names, trainable flags and splits on every rank of the world).

    Why not chunk by chunk: the chunks are cut from each tp rank's own pieces (bucket sizes,
    parameter groups), so tp rank 0's chunk k may hold other parameters than tp rank 1's and
    the ranks may not even have as many chunks; a tp gather issued per chunk could then pair
    different parameters, or wait forever. Here every rank runs, for each name in the one
    order, (1) if it is trainable: one all-reduce of that parameter over the shard group
    (:func:`_gathered`), (2) if the plan splits it: one all-gather of its pieces over the tp
    group (TensorPlan.gather). Every rank issues the same steps in the same order and each
    step's groups partition the world, so, step after step, every group's members all reach
    it: no collective can wait on one that a member has not reached (no deadlock).
    Memory: one whole parameter (plus the tp pieces and the collective's buffers), never a
    chunk beside it nor the model. Traffic: 2(N-1)/N of the fp32 parameter over dp (an
    all-reduce, where the chunk path all-gathers (N-1)/N), then the tp gather."""
    zero.store.drain()                  # disk offload: every write finished (or raised)
    where = {p: (c, i) for c in zero.chunks for i, p in enumerate(c.params)}
    for n, p in zero.model.named_parameters():
        if p in where:
            c, i = where[p]
            piece = _gathered(zero, c, i)
            zero.store.release([c.master], written=False)   # disk: its pages dropped again
        else:                           # frozen: every dp rank holds its tp piece whole
            piece = p.detach().to(zero.device, torch.float32, copy=True)
        # a split piece is gathered on the device; a replicated one is already whole
        yield zero._whole({n: piece if n in zero.plan.specs else piece.cpu()})
        del piece


def _gathered(zero, c, i: int) -> torch.Tensor:
    """Parameter ``i`` of chunk ``c``, whole over the shard group (this tp rank's piece of it;
    fp32 on the compute device) from the masters: each rank writes the elements its master
    shard holds into zeros and one all-reduce sums them (meter ``zero_state_ag``), as int32
    bit patterns, so that x + 0 is x to the bit (an fp32 sum would make -0.0 +0.0)."""
    offset, shape = c.layout.offsets[i], c.layout.shapes[i]
    start, end = c.layout.shard_range(zero.group.rank)
    lo, hi = max(start, offset), min(end, offset + shape.numel())
    whole = torch.zeros(shape.numel(), dtype=torch.float32, device=zero.device)   # (numel,)
    if lo < hi:                         # this rank's elements of the parameter
        whole[lo - offset:hi - offset].copy_(c.master[lo - start:hi - start])
    zero.comm.all_reduce(whole.view(torch.int32), zero.group, name="zero_state_ag")
    return whole.view(shape)


def state_dict(zero, streamed: bool = False) -> dict:
    """This rank's shards: masters and the optimizer (a per-rank file), plus the buffers and
    frozen parameters every rank holds alike. ``streamed`` (:func:`checkpoint_parts`): without
    the masters and the optimizer's element-wise states, which the checkpoint writes as this
    rank's pieces of the layout-free tensors instead (the scalars, such as Adam's step, and the
    parameter groups stay)."""
    zero.store.drain()
    optimizer, streamed_keys = zero.optimizer.state_dict(), None
    if streamed:                # {index in the optimizer's order: the element-wise states}
        streamed_keys = {i: sorted(k for k, v in st.items() if torch.is_tensor(v) and v.dim())
                         for i, st in optimizer["state"].items()}
        optimizer["state"] = {i: {k: v for k, v in st.items() if k not in streamed_keys[i]}
                              for i, st in optimizer["state"].items()}
    return {"stage": zero.stage, "rank": zero.group.rank, "world": zero.group.size,
            "masters": None if streamed else [c.master.detach().cpu().clone()
                                              for c in zero.chunks],
            "streamed": streamed_keys, "optimizer": optimizer, "scale": zero.scaler.state_dict(),
            "buffers": {n: b.detach().cpu().clone() for n, b in zero.model.named_buffers()},
            "frozen": {n: p.detach().cpu().clone() for n, p in zero.model.named_parameters()
                       if not p.requires_grad}}


def checkpoint_parts(zero) -> dict | None:
    """Disk offload (``memory.offload disk``, no tensor parallelism): what a checkpoint writes
    without gathering anything, so that saving needs no more memory than one piece of one
    parameter (the state may be larger than RAM). None for every other ZeRO layout (they save
    the gathered forms: :func:`full_state_dict`, :func:`canonical_optimizer_state`).

    {"model": [(name, shape, lo, hi, values, owner)], "optim": [(name, key, shape, lo, hi,
    values, owner)], "model_whole": {name: tensor}, "optim_whole": {name: {key: tensor}},
    "state": state_dict(streamed=True), "release": store.release, "discard": store.discard,
    "spare": [the store tensors no checkpoint holds: gradient shards, a 16-bit working copy]}
    (a move, ``--checkpoint-move-last``, frees the spare first and each owner once written):
    ``values`` are this rank's elements [lo, hi) of the flattened parameter ``name``
    (``shape``), a view of ``owner``, the store tensor they live in (its pages are dropped once they were read or
    written: ``release([owner], written)``); the fp32 masters for the model, each element-wise
    optimizer state (Adam's exp_avg, exp_avg_sq) for the optimizer. The scalar states (Adam's
    step), the frozen parameters and the buffers are whole. The same function gives the
    tensors an exact resume reads the pieces into (:func:`load_state_dict`). No collective."""
    if zero.store.place != "disk" or getattr(zero, "plan", None) is not None:
        return None
    zero.store.drain()
    names = {p: n for n, p in zero.model.named_parameters()}
    model, optim, optim_whole = [], [], {}
    for c in zero.chunks:
        start, _ = c.layout.shard_range(zero.group.rank)
        for _, lo, hi, view in c.masters:
            state = zero.optimizer.state.get(view, {})
            for p, offset, shape in zip(c.params, c.layout.offsets, c.layout.shapes):
                a, b = max(start + lo, offset), min(start + hi, offset + shape.numel())
                if a >= b:
                    continue
                name = names[p]
                model.append((name, shape, a - offset, b - offset,
                              c.master[a - start:b - start], c.master))
                for key, v in sorted(state.items()):
                    if not torch.is_tensor(v):
                        continue
                    if v.dim() == 0:
                        optim_whole.setdefault(name, {})[key] = v.detach().cpu().clone()
                    else:
                        v = v.detach()
                        optim.append((name, key, shape, a - offset, b - offset,
                                      v[a - start - lo:b - start - lo], v))
    whole = {n: p.detach().float().cpu().clone() for n, p in zero.model.named_parameters()
             if not p.requires_grad}
    whole.update({n: b.detach().cpu().clone() for n, b in zero.model.named_buffers()})
    masters = {c.master.data_ptr() for c in zero.chunks}
    spare = [t for c in zero.chunks for t in (c.grad_shard, c.shard)    # not in a checkpoint
             if t is not None and t.data_ptr() not in masters]
    return {"model": model, "optim": optim, "model_whole": whole, "optim_whole": optim_whole,
            "state": state_dict(zero, streamed=True), "release": zero.store.release,
            "discard": zero.store.discard, "spare": spare}


@torch.no_grad()
def load_state_dict(zero, state: dict, read_parts=None) -> None:
    """This rank's own state (:func:`state_dict`). A streamed one (its masters None) comes with
    ``read_parts``, which reads :func:`checkpoint_parts`' pieces of the checkpoint into the
    store's tensors in place (shardwise/checkpoint/state.py); the optimizer's element-wise
    states are the store's own tensors again afterwards."""
    if (state["stage"], state["world"]) != (zero.stage, zero.group.size):
        raise ValueError(f"checkpoint of ZeRO-{state['stage']} at dp={state['world']} cannot "
                         f"load into ZeRO-{zero.stage} at dp={zero.group.size}; fix: load "
                         "the gathered full_state_dict instead")
    if state["masters"] is None:
        if read_parts is None:
            raise ValueError("a streamed ZeRO checkpoint (disk offload) loads through its "
                             "pieces; fix: resume with shardwise.checkpoint.restore")
        _load_streamed(zero, state, read_parts)
    else:
        for c, m in zip(zero.chunks, state["masters"]):
            c.master.copy_(m)
            c.shard.copy_(c.master)
        zero.optimizer.load_state_dict(state["optimizer"])
    for i, c in enumerate(zero.chunks):
        for _, _, _, view in c.masters:
            zero.store.adopt_state(zero.optimizer.state.get(view, {}))
        zero._launch_gather(i)              # stages 1-2: the whole parameters, gathered again
    zero._finish_gathers()
    if isinstance(state.get("scale"), dict):
        zero.scaler.load_state_dict(state["scale"])
    buffers = dict(zero.model.named_buffers())
    for n, b in state.get("buffers", {}).items():
        buffers[n].copy_(b)
    params = dict(zero.model.named_parameters())
    for n, p in state.get("frozen", {}).items():
        params[n].copy_(p)


def _load_streamed(zero, state: dict, read_parts) -> None:
    """The optimizer's scalars and groups from ``state``, its element-wise states kept in (or,
    where missing, made in) the store, then the masters and those states read in place."""
    views = [p for g in zero.optimizer.param_groups for p in g["params"]]   # state_dict's order
    kept = {view: {k: v for k, v in zero.optimizer.state.get(view, {}).items()
                   if torch.is_tensor(v) and v.dim() > 0} for view in views}
    zero.optimizer.load_state_dict(state["optimizer"])
    for i, view in enumerate(views):
        st = zero.optimizer.state[view]
        for key in state["streamed"].get(i, ()):
            t = kept[view].get(key)
            st[key] = t if t is not None and zero.store.owns(t) else zero.store.zeros_like(view)
    read_parts(checkpoint_parts(zero))
    for c in zero.chunks:
        if c.master.data_ptr() != c.shard.data_ptr():
            c.shard.copy_(c.master)
            zero.store.release([c.shard])


# -- the layout-free optimizer state (shardwise/checkpoint/: reshard) ------------------------
def canonical_optimizer_state(zero, pieces: bool = False,
                              keep: bool = True) -> dict[str, dict[str, torch.Tensor]]:
    """Per parameter (original name, whole tensors on CPU): the element-wise optimizer
    states gathered from every rank's shard views as the masters are in
    ``full_state_dict`` (one all-gather per chunk and state, meter ``zero_state_ag``; then
    the tp pieces), and the scalars (Adam's step) from the views. The state names are
    agreed over dp first (one object collective), since a rank may hold no view of a chunk.
    Memory: one whole chunk per state at a time on the device, the result on CPU.
    ``pieces``: this rank's tensor-parallel pieces, whole over the shard group only; ``keep``
    False (with ``pieces``): take part in the gathers, keep nothing, return {}."""
    zero.store.drain()
    names = {p: n for n, p in zero.model.named_parameters()}
    mine = {}
    for c in zero.chunks:
        for _, _, _, view in c.masters:
            for key, v in zero.optimizer.state.get(view, {}).items():
                if torch.is_tensor(v):
                    mine.setdefault(key, v.detach().cpu().clone() if v.dim() == 0 else None)
    keys: dict = {}
    for part in zero.comm.all_gather_object(mine, zero.group):
        for key, v in part.items():
            if keys.get(key) is None:
                keys[key] = v
    out: dict[str, dict[str, torch.Tensor]] = {}
    for c in zero.chunks:
        for key, scalar in sorted(keys.items()):
            if scalar is not None:      # the same step count for every parameter
                for p in c.params:
                    out.setdefault(names[p], {})[key] = scalar.clone()
                continue
            shard = torch.zeros(c.layout.shard_numel, dtype=torch.float32,
                                device=c.master.device)
            for _, lo, hi, view in c.masters:
                v = zero.optimizer.state.get(view, {}).get(key)
                if v is not None:
                    shard[lo:hi].copy_(v)
            full = torch.empty(c.layout.padded, dtype=torch.float32, device=zero.device)
            zero._all_gather(full, shard.to(zero.device), async_op=False, name="zero_state_ag")
            for p, v in zip(c.params, c.layout.views(full)):
                if keep:
                    out.setdefault(names[p], {})[key] = v.detach().cpu().clone()
            del full, shard
    if not keep:
        return {}
    if zero.plan is not None and not pieces:    # tensor parallel: whole from the tp pieces
        for key, scalar in sorted(keys.items()):
            if scalar is None:
                whole = zero._whole({n: out[n][key] for n, _ in zero.model.named_parameters()
                                     if n in out})
                for n, v in whole.items():
                    out[n][key] = v
    return out


@torch.no_grad()
def load_canonical_optimizer_state(zero, state: dict[str, dict[str, torch.Tensor]],
                                   pieces: bool = False) -> None:
    """Set each master view's optimizer state from whole per-name tensors: every chunk's
    states are laid out flat as its parameters are, and this rank keeps its shard (no
    communication; tensor-parallel pieces cut first, unless ``pieces``: the state holds this
    rank's tp pieces already). Offloaded states move to the store."""
    names = {p: n for n, p in zero.model.named_parameters()}
    for c in zero.chunks:
        present = [state.get(names[p], {}) for p in c.params]
        keys = sorted({k for entry in present for k in entry})
        for key in keys:
            parts = []
            for p, shape, entry in zip(c.params, c.layout.shapes, present):
                v = entry.get(key)
                if v is None:       # (stage 3's p.data is not the whole parameter)
                    parts.append(torch.zeros(shape))
                    continue
                parts.append(v if pieces else zero._tp_piece(names[p], v))   # base.Strategy
            if parts and parts[0].dim() == 0:      # a scalar: every view takes it
                for _, _, _, view in c.masters:
                    zero.optimizer.state[view][key] = parts[0].clone()
                continue
            flat = c.layout.new_flat(parts, torch.float32, c.master.device)
            shard = c.layout.shard(flat, zero.group.rank)
            for _, lo, hi, view in c.masters:
                st = zero.optimizer.state[view]
                if torch.is_tensor(st.get(key)) and st[key].shape == view.shape:
                    st[key].copy_(shard[lo:hi])   # keep a store-owned (offloaded) tensor
                else:
                    st[key] = shard[lo:hi].clone()
        for _, _, _, view in c.masters:
            zero.store.adopt_state(zero.optimizer.state.get(view, {}))
