"""Communication buffers per device: what shardwise's components allocate beside the model
states, modelled component by component (the ledger's ``comm_buffers``; planner/memory.py's
``buffers`` category).

Each kind below is what the component under shardwise/parallel/ actually holds; issue 35's audit
found the earlier rule (two gradient buckets for every data-parallel layout, two boundary
activations per pipeline stage) off by 2x or more, because shardwise's gradient buckets *are*
the gradients (counted there) and its pipeline sends go through shared-memory rings.

``shared``  same-host shared memory, mapped once and kept (persistent). Taken where the ranks
            of one x86 CPU host poll (``train.comm_wait``), which is exactly where a CPU
            calibration finds data parallelism's shared-memory allreduce
            (``Hardware.allreduce_bw > 0``). DDP's and ZeRO's reducer (comm/shm.py, over the
            dp group, ZeRO's shard group under HSDP): one 4 MiB slot per member, a 4 MiB
            result region and a 64-byte counter per member, ``(N + 1) 4 MiB + 64 N``. A pipeline stage (comm/shm_p2p.py): a byte ring per ordered pair of
            neighbours it sends to or receives from (2 rings at pp = 2, 4 from pp = 3: the
            ring wraps for interleaving), each ``2 x`` one fp32 boundary activation
            ``(b, s / cp, h)``, at least 64 KiB, at most 4 MiB, whole pages, plus two 64-byte
            counters. Elsewhere (NCCL, gloo's own send / recv and allreduce) nothing: a
            received activation is the stage's input, which its activations count.
``staging`` ZeRO's whole-size gradient buffers and reduce-scatter temporaries
            (parallel/data/zero.py). ZeRO-1: every bucket's reduce-scatter is launched in
            backward into a ``1/N`` temporary and waited at the step: ``G / N`` in all (G the
            device's gradient bytes). ZeRO-2: a bucket's gradients fill a whole-size buffer,
            reduce-scattered when full; a new buffer first waits for the oldest reductions
            while two are live (one filling, one reducing), so for buckets that fill one
            after another the peak is the largest two consecutive ``B_i + B_{i+1}`` (one
            bucket: G). A bucket whose first gradient comes early and last late (Llama
            registers its norms after the matrices but uses them first) holds its buffer
            beside the next ones: :func:`zero2_backward` replays backward in order of use.
            Under a pipeline every buffer is kept until the last micro-batch (G). The buckets
            are ``comm/buckets.plan_buckets``'s, replayed on ``ModelSpec.block_tensors``:
            closed once they hold ``bucket_bytes``, so a bucket over-runs it by up to one
            tensor. ZeRO-3: one unit's gradient buffer (see ``gathered``).
``gathered`` ZeRO-3's whole units (zero_stage3.py): every block is a unit, each other module
            with parameters one of its own (token and position tables, final norm, head; a
            tied weight sits in the root unit, gathered throughout). In forward unit i is
            held while unit i+1's all-gather is in flight; in backward unit i is held, its
            gradient buffer fills and unit i-1's gather is in flight: ``2 U_i + U_{i-1}``
            (+ the backend's copy of U_{i-1}). A blocking reduce-scatter (CPU) frees the
            buffer before the next unit; an asynchronous one (CUDA) keeps U_{i+1}'s buffer
            too, ``2 U_i + U_{i+1} + U_{i-1}``.
``backend`` what the backend allocates for ZeRO's collectives in flight, ``copies``
            (``Hardware.collective_copies``) times their whole tensors: gloo copies a
            reduce-scatter's input and gathers into a whole-size temporary (zero_memory.py),
            NCCL and the same-host shared memory (where ``shared``) do not (0). ZeRO-1: the whole G (every reduce-scatter in flight till the
            step); ZeRO-2: the two buckets reducing; ZeRO-3: the unit in flight. ``copies > 0``
            also marks the CPU, where ZeRO-3 blocks its reduce-scatters.

Measured (world 2, gloo, the benchmark GPT 4 x 256, fp32: G = 13.28 MB, a block U = 3.16 MB),
before ZeRO's collectives went through shared memory: DDP 12.58 MB (the region), ZeRO-1 19.92
(G/2 + G), ZeRO-2 26.56 (2G), ZeRO-3 12.62 (4U), pp 1.05 (two 512 KiB rings), 3d at world 4
(no polling: gloo's p2p) 10.06 (the stage's G/2 + G). Where shared memory now serves ZeRO,
its region replaces the backend's copies. tests/planner/test_planner_buffers.py compares these
formulas with real ledgers, whichever path each run took.
"""
from __future__ import annotations

from shardwise.planner.layout import Batch, Layout
from shardwise.planner.model import ModelSpec

KINDS = ("shared", "staging", "gathered", "backend")
SHM_CHUNK = 4 << 20          # comm/shm.py CHUNK_BYTES
RING_MIN, RING_MAX, PAGE, LINE = 64 << 10, 4 << 20, 4096, 64   # comm/shm_p2p.py


def block_use_order(model: ModelSpec) -> list[int]:
    """Indices of ``block_tensors`` in the order forward uses them (backward produces their
    gradients in the reverse): registration order for GPT-2's layout; Llama registers its two
    norms last but uses each before its sub-layer (input norm, q k v o, post-attention norm,
    gate up down)."""
    n = len(model.block_tensors())
    if model.gated_mlp and not model.biases:     # q k v o gate up down norm1 norm2
        return [7, 0, 1, 2, 3, 8, 4, 5, 6]
    return list(range(n))


def stage_tensors(model: ModelSpec, pp: int, stage: int) -> tuple[list[int], list[int]]:
    """(element counts of a pipeline stage's parameter tensors in registration order, each
    one's position in forward's order of use)."""
    from shardwise.planner.memory import layers_on_stage
    sizes: list[int] = []
    if stage == 0:
        sizes += [model.vocab * model.hidden]
        sizes += [model.seq_len * model.hidden] if model.learned_positions else []
    head = len(sizes)
    block, order = model.block_tensors(), block_use_order(model)
    use = list(range(head))
    for layer in range(layers_on_stage(model, pp, stage)):
        base = len(sizes)
        sizes += block
        place = {t: k for k, t in enumerate(order)}
        use += [base + place[t] for t in range(len(block))]
    tail = len(sizes)
    if stage == pp - 1:
        sizes += [model.norm_params]
        if not model.tied_embeddings or pp > 1:
            sizes += [model.vocab * model.hidden]
    use += list(range(tail, len(sizes)))
    return sizes, use


def stage_units(model: ModelSpec, pp: int, stage: int) -> tuple[list[int], int]:
    """(ZeRO-3's units of a stage in forward order, the root unit) in elements: the tables,
    one per block, the final norm, the head; a weight tied on one device is the root's."""
    from shardwise.planner.memory import layers_on_stage
    units: list[int] = []
    if stage == 0:
        units += [] if model.tied_embeddings and pp == 1 else [model.vocab * model.hidden]
        units += [model.seq_len * model.hidden] if model.learned_positions else []
    units += [model.layer_params] * layers_on_stage(model, pp, stage)
    if stage == pp - 1:
        units += [model.norm_params]
        tied_here = model.tied_embeddings and pp == 1          # then the root's
        units += [] if tied_here else [model.vocab * model.hidden]
    root = model.vocab * model.hidden if model.tied_embeddings and pp == 1 else 0
    return units, root


def plan_buckets(sizes: list[float], bucket: float) -> list[list[int]]:
    """Tensor indices per bucket as comm/buckets.plan_buckets makes them: last tensors first,
    a bucket closed once it holds at least ``bucket``."""
    out, current, size = [], [], 0.0
    for i in reversed(range(len(sizes))):
        current.append(i)
        size += sizes[i]
        if bucket > 0 and size >= bucket:
            out.append(current)
            current, size = [], 0.0
    return out + ([current] if current else [])


def zero2_backward(sizes: list[float], use: list[int], bucket: float, c: float,
                   n: int, accumulating: bool) -> dict:
    """ZeRO-2's staging peak, replayed as parallel/data/zero.py runs backward: gradients
    arrive in the reverse of ``use``; a bucket's whole-size buffer opens at its first gradient
    (first waiting for the oldest reductions while two buffers are already live); a bucket is
    launched when it and every bucket before it are complete (launch order is index order),
    with the backend's copy, and freed when retired. So a bucket whose first gradient comes
    early and last late (Llama's norms) holds its buffer beside the next ones."""
    buckets = plan_buckets(sizes, bucket)
    of = {i: b for b, idx in enumerate(buckets) for i in idx}
    size = [sum(sizes[i] for i in idx) for idx in buckets]
    pending = [len(idx) for idx in buckets]
    live = {"staging": 0.0, "backend": 0.0}
    best, filling, reducing, nxt = dict(live), set(), [], 0

    def note():
        nonlocal best
        if sum(live.values()) > sum(best.values()):
            best = dict(live)
    for i in sorted(range(len(sizes)), key=lambda t: -use[t]):
        b = of[i]
        if b not in filling and pending[b] == len(buckets[b]):
            while reducing and len(reducing) + len(filling) >= 2:
                done = reducing.pop(0)
                live["staging"] -= size[done] * (1 + (1 / n if accumulating else 0))
                live["backend"] -= c * size[done]
            filling.add(b)
            live["staging"] += size[b]
            note()
        pending[b] -= 1
        while nxt < len(buckets) and pending[nxt] == 0:
            filling.discard(nxt)
            reducing.append(nxt)
            live["staging"] += size[nxt] / n if accumulating else 0.0
            live["backend"] += c * size[nxt]
            nxt += 1
            note()
    return best


def _scaled(sizes: list[int], total: float) -> list[float]:
    """``sizes`` scaled to sum to ``total`` (a tensor-parallel slice, or a caller's p_dev)."""
    whole = sum(sizes)
    return [s * total / whole for s in sizes] if whole else []


def shared_bytes(model: ModelSpec, layout: Layout, shared: bool) -> float:
    """Same-host shared memory this rank maps (module docstring, ``shared``)."""
    if not shared:
        return 0.0
    out = 0.0
    group = layout.dp_shard if layout.zero else layout.dp * layout.cp     # the reducer's group
    if group > 1 and not layout.num_ps:
        out += (group + 1) * SHM_CHUNK + group * LINE
    if layout.pp > 1:
        message = 4 * layout.micro_batch * (model.seq_len // layout.cp) * model.hidden
        ring = -(-min(RING_MAX, max(RING_MIN, 2 * message)) // PAGE) * PAGE
        out += (2 if layout.pp == 2 else 4) * (ring + 2 * LINE)
    return out


def _zero3(units: list[float], root: float, c: float, accumulating: bool, n: int) -> tuple:
    """ZeRO-3's (forward, backward) peaks as {kind: bytes} (module docstring, ``gathered``)."""
    u = [0.0, *units, 0.0]                       # padded: u[i] is unit i - 1
    fwd = {"gathered": u[1], "backend": c * u[1]}      # the first unit, gathered blocking
    for i in range(1, len(u) - 1):                     # unit i held, i + 1 in flight
        fwd = max(fwd, {"gathered": u[i] + u[i + 1], "backend": c * u[i + 1]},
                  key=lambda d: sum(d.values()))
    best: dict = {}
    for i in range(1, len(u) - 1):
        temp = u[i] / n if accumulating else 0.0   # added into an accumulated shard
        later = u[i + 1] if not c else 0.0         # an asynchronous reduce-scatter's buffer
        filling = {"gathered": u[i] + u[i - 1], "staging": u[i] + later,
                   "backend": c * u[i - 1]}
        reducing = {"gathered": u[i - 1], "staging": u[i] + temp + later,
                    "backend": c * (u[i] + u[i - 1])}
        best = max(best, filling, reducing, key=lambda d: sum(d.values()))
    for d in (fwd, best):
        d["gathered"] = d.get("gathered", 0.0) + root
    return fwd, best


def zero_phases(model: ModelSpec, layout: Layout, batch: Batch, p_dev: float, copies: float,
                stage: int = 0) -> tuple[dict, dict]:
    """ZeRO's transient buffers as ({kind: bytes} live in forward, {kind: bytes} at their
    peak in backward and the step) for one device of ``stage`` holding ``p_dev`` parameters."""
    n = layout.dp_shard
    if not layout.zero or (n == 1 and not layout.offloaded) or layout.num_ps:
        return {}, {}
    c = copies if n > 1 else 0.0                 # a group of one copies nothing
    work = 2 if batch.mixed else 4               # ZeRO's chunks are in the working dtype
    accumulating = layout.microbatches(batch.global_batch) > 1
    if layout.zero >= 3:
        units, root = stage_units(model, layout.pp, stage)
        whole = sum(units) + root
        scale = p_dev / whole if whole else 0.0
        return _zero3([work * x * scale for x in units], work * root * scale, c, accumulating, n)
    g = work * p_dev
    if layout.zero == 1:
        return {}, {"staging": g / n, "backend": c * g}
    if layout.pp > 1:                            # every buffer kept to the last micro-batch
        return {}, {"staging": g, "backend": c * g}
    sizes, use = stage_tensors(model, layout.pp, stage)
    return {}, zero2_backward(_scaled(sizes, g), use, layout.bucket_bytes, c, n, accumulating)


def buffer_parts(model: ModelSpec, layout: Layout, batch: Batch, p_dev: float,
                 copies: float = 0.0, stage: int = 0, shared: bool = False) -> dict:
    """Communication buffers by kind (module docstring) at their own peak: the persistent
    ``shared`` memory plus ZeRO's transient kinds at their larger phase."""
    fwd, bwd = zero_phases(model, layout, batch, p_dev, copies, stage)
    peak = max(fwd, bwd, key=lambda d: sum(d.values()))
    parts = dict.fromkeys(KINDS, 0.0)
    parts.update(peak)
    parts["shared"] = shared_bytes(model, layout, shared)
    return parts


def forward_buffers(model: ModelSpec, layout: Layout, batch: Batch, p_dev: float,
                    copies: float = 0.0, stage: int = 0) -> float:
    """Transient buffer bytes live in forward, beside the saved activations (ZeRO-3's units)."""
    return sum(zero_phases(model, layout, batch, p_dev, copies, stage)[0].values())
