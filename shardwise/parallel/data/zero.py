"""ZeRO stages 1 and 2 (this file) and 3 (zero_stage3.py): data parallelism that shards the
training state over the N data-parallel ranks instead of replicating it.

Reference: Rajbhandari, Rasley, Ruwase, He, "ZeRO: Memory Optimizations Toward Training Trillion
Parameter Models", SC 2020. P = parameter count; bytes per rank for Adam (two fp32 moments):

    stage   shards                         mixed precision (bf16/fp16)   fp32 (no master copy)
    DDP     nothing                        16P                           16P
    1       optimizer states (+ masters)   4P + 12P/N                    8P + 8P/N
    2       + gradients                    2P + 14P/N                    4P + 12P/N
    3       + parameters                   16P/N                         16P/N

Traffic per step (K = bytes of the flat parameters, padded): stages 1 and 2 reduce-scatter the
gradients ((N-1)/N K) and all-gather the updated parameters ((N-1)/N K): 2(N-1)/N K, the volume
of one DDP allreduce. Stage 3 all-gathers each unit before its forward and again before its
backward, and reduce-scatters its gradients: 3(N-1)/N K, 1.5x DDP. Padding: each chunk is
rounded up to a multiple of N elements (at most N-1 extra per chunk).

Stage 1 (:class:`Zero1Strategy`) keeps whole parameters and whole gradients (``p.grad`` are views
of one flat buffer per bucket, so autograd accumulates into it in place). When a bucket's last
gradient arrives (post-accumulate-grad hooks; during backward with ``overlap``, after it
without) its reduce-scatter starts; inside ``no_sync`` nothing is sent and gradients accumulate.
Stage 2 (:class:`Zero2Strategy`) gives a bucket a staging buffer on its first gradient (every
``.grad`` of the bucket becomes a view of it; zero_base.py), reduce-scatters it into a 1/N
gradient shard as soon as the bucket is ready and frees it when that finishes: at most two
whole-size buckets live at once (one filling, one reducing), so whole gradients never persist
(inside ``no_sync`` it still reduce-scatters each micro-step, into the accumulating shard).
With ``overlap`` off the reduce-scatter blocks, but still runs when the bucket is ready.
Parameters of a bucket are laid out by optimizer parameter group; frozen parameters are in no
bucket (zero_base.py).

The step, in three phases (nanoGPT's shape; one rank runs it unchanged): wait for the
reduce-scatters; for each bucket, step the optimizer on its fp32 master shard, copy the result
into the working shard and start the bucket's all-gather; wait for the all-gathers.
Buckets hold parameters in reverse order (backward produces the last layers' gradients first),
about ``parallel.bucket_mb`` each. World size 1: every collective is a copy and the result is
plain training.
"""
from __future__ import annotations

from shardwise.comm.buckets import plan_buckets
from shardwise.comm.flat import free_storage, storage_bytes
from shardwise.parallel.data.zero_base import Chunk, ZeroBase
from shardwise.parallel.data.zero_stage3 import Zero3Strategy  # noqa: F401  (registry name zero3)


class _BucketedZero(ZeroBase):
    """Stages 1 and 2: whole parameters on every rank, flat buckets, sharded optimizer."""

    def wrap(self, model, optimizer_factory) -> None:
        params = self._adopt(model, optimizer_factory)          # registration order
        sizes = [p.numel() * self.dtype.itemsize for p in params]  # working-precision bytes
        for idx in plan_buckets(sizes, self.cfg.parallel.bucket_mb * 2**20):   # last first
            c = self._make_chunk([params[i] for i in idx], full_sharded=False)
            self._init_grads(c)
            self.chunks.append(c)
        self._build_optimizer()
        self._gathers: list = []
        self._next = 0                       # next bucket to launch (launch order = index order)

    def _init_grads(self, c: Chunk) -> None:
        raise NotImplementedError

    def _chunk_ready(self, index: int) -> None:
        """A bucket's gradients are all in: launch buckets in index order on every rank."""
        self.chunks[index].extra["ready"] = True
        if self.overlap:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next < len(self.chunks) and self.chunks[self._next].extra.get("ready"):
            c = self.chunks[self._next]
            c.extra["ready"] = False
            self._next += 1
            self._launch(c)

    def _launch(self, c: Chunk) -> None:
        raise NotImplementedError

    def _after_backward(self) -> None:
        self._launch_ready()               # overlap off: everything launches now
        self._next = 0
        if not self._syncing and self.stage == 2:
            self._finish_reductions()      # accumulate this micro-step into the shard now

    MAX_GATHERS = 2     # all-gathers in flight at once after the step (each holds a backend copy)

    def _after_chunk_step(self, index: int) -> None:
        """Start the bucket's all-gather; with the oldest waited first when ``MAX_GATHERS`` are
        in flight, since gloo keeps a whole-bucket temporary alive until each is waited."""
        c = self.chunks[index]
        while len(self._gathers) >= self.MAX_GATHERS:
            self._wait_gather(self._gathers.pop(0))
        backend = self._backend_bytes(storage_bytes(c.full))
        self._alloc("backend", backend)
        self._gathers.append((self._all_gather(c.full, c.shard, async_op=self.overlap), backend))

    def step(self) -> None:
        super().step()
        self._finish_gathers()

    def _finish_gathers(self) -> None:
        """Phase 3: every rank holds the whole updated parameters again."""
        while self._gathers:
            self._wait_gather(self._gathers.pop(0))

    def _wait_gather(self, entry: tuple) -> None:
        work, backend = entry
        work.wait()
        self._release("backend", backend)

    def _param_bytes(self) -> int:
        return sum(storage_bytes(c.full) for c in self.chunks)


class Zero1Strategy(_BucketedZero):
    """ZeRO-1: optimizer states (and fp32 masters) sharded; whole parameters and gradients kept.

    Partition: rank r owns slice r of each flat bucket's optimizer state and master weights.
    Collectives: reduce-scatter of each bucket's gradients (during backward with overlap), then
    all-gather of the updated parameters after the step. Memory per rank (Adam): mixed precision
    4P + 12P/N, fp32 8P + 8P/N. Traffic per step: 2(N-1)/N K, as DDP. Reference: ZeRO (SC 2020),
    "P_os".
    """
    name, stage = "zero1", 1

    def _init_grads(self, c: Chunk) -> None:
        c.grad_full = c.layout.new_flat(dtype=self.dtype, device=self.device)
        c.grad_shard = c.layout.shard(c.grad_full, self.group.rank)
        for p, view in zip(c.params, c.layout.views(c.grad_full)):
            p.grad = view                      # autograd accumulates into the bucket in place

    def _chunk_ready(self, index: int) -> None:
        if self._syncing:                      # inside no_sync: keep accumulating, send nothing
            super()._chunk_ready(index)

    def _launch(self, c: Chunk) -> None:
        c.grad_valid = True                    # launched this step (_reduce_held skips it)
        if self._ring is not None:             # the ring reduces in place: own slice is the answer
            work = self._reduce_scatter(c.grad_shard, c.grad_full, async_op=True)
            self._reducing.append((c, work, None, None, "into", 0))
        else:                                  # the backend may not write its input: a temporary
            temp = c.grad_shard.new_empty(c.grad_shard.shape)
            self._alloc("staging", storage_bytes(temp))
            backend = self._backend_bytes(storage_bytes(c.grad_full))
            self._alloc("backend", backend)
            work = self._reduce_scatter(temp, c.grad_full, async_op=self.overlap)
            self._reducing.append((c, work, temp, None, "copy", backend))

    def _zero_grads(self) -> None:
        for c in self.chunks:
            c.grad_full.zero_()

    def _grad_bytes(self) -> int:
        return sum(storage_bytes(c.grad_full) for c in self.chunks)


class Zero2Strategy(_BucketedZero):
    """ZeRO-2: optimizer states and gradients sharded; whole parameters kept.

    Partition: rank r owns slice r of each bucket's gradients, optimizer state and masters.
    Collectives: as ZeRO-1, but each bucket's gradients accumulate in a staging buffer that is
    reduce-scattered as soon as the bucket is ready and freed when that finishes, so only a 1/N
    gradient shard persists. Memory per rank (Adam): mixed precision 2P + 14P/N, fp32 4P + 12P/N,
    plus at most two whole-size bucket buffers (``comm_buffers``, the high-water mark).
    Traffic per step: 2(N-1)/N K, as DDP. Reference: ZeRO (SC 2020), "P_os+g".
    """
    name, stage = "zero2", 2

    def _init_grads(self, c: Chunk) -> None:
        c.grad_shard = c.shard.new_zeros(c.shard.shape)
        free_storage(c.grad_shard)             # alive from its reduce-scatter to the step

    def _chunk_ready(self, index: int) -> None:
        """Launch now even with overlap off (the collective then blocks): a ready bucket's
        staging buffer is freed at once instead of waiting for the end of backward. Under a
        pipeline (``accumulate_unsharded``) only the step's last backward launches; the
        earlier micro-batches accumulate into the whole staging buffer."""
        if self.accumulate_unsharded and not self._syncing:
            return
        self.chunks[index].extra["ready"] = True
        self._launch_ready()

    def _launch(self, c: Chunk) -> None:
        self._reduce_staged(c)

    def _grad_bytes(self) -> int:
        return self._grad_shard_bytes()
