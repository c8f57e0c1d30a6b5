"""ZeRO's memory ledger (stages 1-3): the bytes a rank holds, by category, and the high-water marks
of the transient buffers. A mixin of :class:`~shardwise.parallel.data.zero_base.ZeroBase`.

Transient buffers are accounted by kind, when they are allocated and freed:

    staging    whole-size gradient buffers (stages 2-3) and reduce-scatter temporaries
    gathered   stage 3's whole units, from the start of their all-gather to their release
    backend    what the backend itself allocates for a collective in flight: gloo (the CPU
               backend) runs ``reduce_scatter_tensor`` as an allreduce of a copy of the whole
               input, and ``all_gather_into_tensor`` into a whole-size temporary (measured: a 50 MiB
               reduce-scatter or all-gather raises resident memory by 50 MiB, an in-place
               allreduce by 2 MiB); each lives from the launch until the collective is waited.
               shardwise's ring (``--allreduce ring``) works in place: nothing is counted.

``comm_buffers`` is the high-water mark of all kinds together (``transient_peaks()['total']``).
``activations_peak`` is the sum of the distinct storages autograd saved for backward in one
forward (parameters and views of them excluded). The ledger is what this rank's training state
costs: with malloc returning freed memory (shardwise/bench/memory.py) the measured peak resident
memory minus the resident memory after ``import torch`` should come within a few percent of it.
"""
from __future__ import annotations

from shardwise.comm.flat import storage_bytes
from shardwise.parallel.base import optimizer_state_bytes, tensor_bytes

KINDS = ("staging", "gathered", "backend")


class ZeroLedger:
    """Transient-buffer accounting and the ledger for ZeroBase (saved activations are measured
    by parallel/ledger.py, as for every stage; so is the instant they peak together)."""

    def _init_ledger(self) -> None:
        self._live = dict.fromkeys(KINDS, 0)               # transient bytes now, by kind
        self._peak = {**dict.fromkeys(KINDS, 0), "total": 0}   # their high-water marks

    # -- transient memory -----------------------------------------------------------------
    def _alloc(self, kind: str, nbytes: int) -> None:
        """Account a transient buffer; the ledger reports high-water marks."""
        self._live[kind] += nbytes
        self._peak[kind] = max(self._peak[kind], self._live[kind])
        self._peak["total"] = max(self._peak["total"], sum(self._live.values()))
        self._note_instant()                               # parallel/ledger.py

    def _transient_live(self) -> int:
        return sum(self._live.values())

    def _transients_sampled(self) -> bool:
        return True

    def _grads_live(self) -> int | None:
        """Stages 2-3: the gradient shards' bytes alive now (stage 1's are bucket views)."""
        if self.stage < 2:
            return None
        if self.grads_offloaded:
            return None                        # in the store for the whole run (memory_ledger)
        return sum(storage_bytes(c.grad_shard) for c in self.chunks)

    def _release(self, kind: str, nbytes: int) -> None:
        self._live[kind] -= nbytes

    def _backend_bytes(self, nbytes: int) -> int:
        """Bytes the backend allocates for a reduce-scatter / all-gather over ``nbytes`` (the
        whole, unsharded size): gloo copies it, the ring and a group of one do not."""
        native = self._ring is None and self.group.size > 1
        return nbytes if native and self.device.type == "cpu" else 0

    # -- the ledger -----------------------------------------------------------------------
    def memory_ledger(self) -> dict[str, int]:
        """Bytes this rank holds by category. ``comm_buffers`` is the high-water mark of every
        transient buffer together (see the module docstring); :meth:`transient_peaks` splits it.
        The categories count memory (the device's, and for ``offload cpu`` on a GPU the host's
        too, as masters and states always were); ``on_disk`` counts, apart, what disk offload
        keeps in memory-mapped files: masters, optimizer states, and with ``--offload-params``
        the parameter and gradient shards (each tensor once; the pages a step has read in are
        transient and dropped again, memory/offload.py)."""
        masters = [c.master for c in self.chunks if c.master.data_ptr() != c.shard.data_ptr()]
        master_bytes = tensor_bytes(masters)
        state_bytes = optimizer_state_bytes(self.optimizer)
        on_disk = 0
        if self.store.place == "disk":
            on_disk, master_bytes, state_bytes = master_bytes + state_bytes, 0, 0
            on_disk += self._stored_bytes()
        return {"parameters": self._param_bytes() + tensor_bytes(self.frozen),
                "gradients": self._grad_bytes(), "optimizer_states": state_bytes,
                "master_weights": master_bytes, "comm_buffers": self._peak["total"],
                "activations_peak": self._act_peak, "on_disk": on_disk}

    def _stored_bytes(self) -> int:
        """Parameter and gradient shards that ``--offload-params`` keeps in the store."""
        shards = [c.shard for c in self.chunks] if self.params_offloaded else []
        grads = [c.grad_shard for c in self.chunks] if self.grads_offloaded else []
        return tensor_bytes(shards + grads)

    def transient_peaks(self) -> dict[str, int]:
        """High-water marks: ``staging`` (whole-size gradient buffers and temporaries),
        ``gathered`` (stage 3's whole units), ``backend`` (the backend's own copies),
        ``total`` (all at once)."""
        return dict(self._peak)

    def _param_bytes(self) -> int:
        raise NotImplementedError

    def _grad_bytes(self) -> int:
        raise NotImplementedError
