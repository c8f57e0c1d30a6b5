"""Offload to disk: the bytes a step moves through the node's disk, and when only disk fits.

What shardwise's ZeRO moves per rank and step (shardwise/parallel/data/zero_stage3.py; the
ledger's ``on_disk``), ``p`` / ``g`` / ``s`` the bytes of this rank's 16-bit parameter shard,
fp32 gradient shard and master + optimizer states, ``m`` micro-batches:

- ``offload=disk`` (master and optimizer states on disk): one read and one write of ``s``;
- ``offload_params=disk`` (ZeRO-3, ZeRO-Infinity's parameter offload): the parameter shard is
  read for every unit's forward and backward gather of each micro-batch and once by the
  optimizer (``2 m + 1`` reads, the runtime's "3 reads" at m = 1) and written back once; the
  gradient shard is written after each micro-batch's reduction and read by the optimizer
  (``m + 1`` moves, "2 of the gradients" at m = 1).

The node's disk serves every rank of the node at ``Hardware.disk_bw`` (a calibration measures
it: shardwise/launch/calibrate.py's ``measure_disk``) when the disk state is large; when it is
small beside the host's memory, shardwise's default ``--offload-sync auto`` leaves the writes to
the kernel's writeback and the page cache serves the reads, so the I/O runs at host memory
bandwidth (:func:`disk_rate`).
"""
from __future__ import annotations

from shardwise.planner.layout import Batch, Layout
from shardwise.planner.memory import state_bytes


def disk_bytes_per_step(layout: Layout, batch: Batch, owned: float, m: int) -> float:
    """Bytes one rank reads and writes on disk per step, for ``owned`` parameters of its shard
    over ``m`` micro-batches (module docstring)."""
    per = state_bytes(batch)
    moved = 0.0
    if layout.offload == "disk":
        states = (per["master_weights"] or per["parameters"]) + per["optimizer_states"]
        moved += 2 * states * owned
    if layout.offload_params == "disk":
        moved += (2 * m + 2) * per["parameters"] * owned
        moved += (m + 1) * 4 * owned
    return moved


def disk_rate(hw, disk_per_node: float, host_per_node: float) -> float:
    """Bytes/s a node's offload I/O runs at. The runtime's ``--offload-sync auto``
    (shardwise/memory/offload_io.py ``sync_needed``) syncs each write only when the node's
    offloaded state exceeds a quarter of the memory available; the planner takes the host's
    memory less what cpu offload keeps there. Below that, the writes go to the page cache
    (written back by the kernel off the step) and the reads come from it: ``host_mem_bw``;
    above it, the disk: ``disk_bw``."""
    free = max(0.0, hw.host_memory_bytes - host_per_node)
    return hw.host_mem_bw if disk_per_node <= free / 4 else hw.disk_bw


def runtime_flags(layout: Layout) -> str:
    """The ``shardwise train`` flags of ``layout``'s offload, or the planner's terms where
    shardwise train has none (parameters offloaded elsewhere than the optimizer)."""
    if layout.offload_params == "none":
        return f"--offload {layout.offload}"
    if layout.offload_params == layout.offload:
        return f"--offload {layout.offload} --offload-params"
    return f"offload={layout.offload} offload_params={layout.offload_params}"
