"""The one door to torch.distributed.checkpoint (DCP): save, load and read the metadata.

DCP's own collectives (gathering the save plans, the coordinator's metadata write, the final
all-reduce) run over the explicit group passed in, the world's (shardwise/mesh.py); a world of
one (``Group.pg is None``) runs DCP without a process group. Save: each rank writes one file
``__<rank>_0.distcp``; a key held by several ranks with equal values (the canonical model, the
shared progress) is written once (DCP's de-duplication); the coordinator (rank 0 of the group)
writes ``.metadata`` and every rank returns only after it has, so when ``save`` returns on every
rank the folder is complete. Load fills a template in place: tensors are copied into the given
tensors (any size DCP can cut from the stored chunks), a ``BytesIO`` (or any non-tensor) value
is replaced by what was stored.

Background saves (``save_async``, ``train.checkpoint_async``): DCP's ``async_save`` with its
thread executor, over a gloo group made for it (``new_save_group``), so that its collectives in
the writer thread never share a group with the training thread's.

DCP is imported on first use, not with this module: its import (DTensor and its op tables)
takes seconds, and a run that never saves or resumes should not pay it in every rank.
"""
from __future__ import annotations

import io
import warnings

import torch

from shardwise.comm.collectives import Group


def _writer(folder: str):
    """DCP's file writer without its copy-ahead loader: that loader (used wherever CUDA is
    present) asks CUDA for its current stream, which initialises CUDA even for a CPU run (and
    fails in a forked CPU world: "Cannot re-initialize CUDA in forked subprocess"). Every tensor
    a checkpoint holds is on the CPU already (canonical.py; the rest is bytes): nothing to
    copy ahead."""
    from torch.distributed.checkpoint import FileSystemWriter
    return FileSystemWriter(folder, per_thread_copy_ahead=0)


def save(state: dict, folder: str, group: Group, pieces=None, release=None,
         discard=None) -> None:
    """Write ``state`` (a flat dict of tensors and objects) into ``folder`` from every rank;
    ``pieces`` (checkpoint/pieces.py): besides, this rank's boxes of layout-free tensors,
    written straight from the (memory-mapped) store tensors they view, each store tensor's
    pages dropped with ``release([owner], False)`` once the writer has moved past it (disk
    offload). ``discard`` (a move: ``--checkpoint-move-last``): ``discard([owner])`` frees a
    store tensor's disk blocks once the writer has written the last box in its storage
    (owners may be views of one store tensor), so the checkpoint takes the place of the offload files instead of being a second copy."""
    import torch.distributed.checkpoint as dcp
    planner = _piece_saver(pieces, release, discard) if pieces else None
    written = False
    try:
        if group.pg is None:
            with warnings.catch_warnings():     # "assuming ... a single process": it is one
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(state, checkpoint_id=folder, storage_writer=_writer(folder),
                         planner=planner, no_dist=True)
        else:
            dcp.save(state, checkpoint_id=folder, storage_writer=_writer(folder),
                     planner=planner, process_group=group.pg)
        written = True
    finally:
        if planner is not None:
            planner.done(written)


def load_pieces(pieces, folder: str, group: Group | None, release=None) -> None:
    """Read the stored values of ``pieces`` (each a box of a layout-free tensor, whichever
    ranks wrote it) into their tensors in place, then ``release([owner], True)`` each owner's
    pages (written back to its file). Collective over ``group`` like :func:`load`."""
    import torch.distributed.checkpoint as dcp
    planner = _piece_loader(pieces, release)
    if group is None or group.pg is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load({}, checkpoint_id=folder, planner=planner, no_dist=True)
    else:
        dcp.load({}, checkpoint_id=folder, planner=planner, process_group=group.pg)


def _piece_saver(pieces, release, discard=None):
    """DCP's default save planner plus one SHARD write item per piece (its box of the key).

    DCP's writer (one thread, no copy-ahead: :func:`_writer`) asks ``resolve_data`` for an
    item only once it has written the one before (it sorts the items by size, so one owner's
    boxes need not be consecutive): so at each call the previous box is on its way to the file
    (torch.save has copied its bytes), and an owner whose boxes are all written can go."""
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (TensorWriteData, WriteItem,
                                                      WriteItemType)
    by_index = {(p.key, tuple(p.offsets)): p for p in pieces}
    def home(p) -> int:                     # the memory an owner lives in (views share it)
        return p.owner.untyped_storage().data_ptr()
    left: dict[int, int] = {}               # owner's storage -> its boxes not yet written
    for p in pieces:
        if p.owner is not None:
            left[home(p)] = left.get(home(p), 0) + 1

    class Planner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = [WriteItem(index=MetadataIndex(p.key, p.offsets), type=WriteItemType.SHARD,
                               tensor_data=TensorWriteData(
                                   chunk=ChunkStorageMetadata(offsets=torch.Size(p.offsets),
                                                              sizes=p.data.shape),
                                   properties=TensorProperties(dtype=p.data.dtype),
                                   size=torch.Size(p.shape)))
                     for p in pieces]
            self.plan = dataclasses.replace(plan, items=[*plan.items, *items])
            return self.plan

        owner = None                        # the store tensor the last box came from
        last = None                         # the last box handed to the writer

        def resolve_data(self, write_item):
            self._written()                 # the writer asks for an item once the last is written
            p = by_index.get((write_item.index.fqn, tuple(write_item.index.offset or ()))) \
                if write_item.type == WriteItemType.SHARD else None
            if p is None:
                return super().resolve_data(write_item)
            if p.owner is not self.owner:
                self._drop()
                self.owner = p.owner
            self.last = p
            return _exact(p.data)

        def _written(self) -> None:
            """The last box is written: with ``discard``, free its owner after its last box."""
            p, self.last = self.last, None
            if p is None or discard is None or p.owner is None:
                return
            left[home(p)] -= 1
            if left[home(p)] == 0:          # every box in that storage is written
                if self.owner is p.owner:
                    self._drop()
                discard([p.owner])

        def _drop(self) -> None:
            """Drop the pages of the store tensor the last box came from."""
            if release is not None and self.owner is not None:
                release([self.owner], False)
            self.owner = None

        def done(self, written: bool = True) -> None:
            """After the writer (``written``) or a failure: the last box's owner is done with."""
            if written:
                self._written()
            self._drop()
    return Planner()


def _exact(t: torch.Tensor) -> torch.Tensor:
    """``t`` (contiguous) as a tensor whose storage is exactly its own bytes, in the same memory.
    DCP's writer copies a tensor whose storage is larger (a view of a store tensor) and keeps
    every tensor it wrote until the save ends (its ``tensor_dict``, for the safetensors
    format): copies would pile up to this rank's whole share in anonymous memory; views of the
    mapped files hold only file pages, which the planner drops again."""
    import ctypes
    buffer = (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())
    return torch.frombuffer(buffer, dtype=t.dtype).view(t.shape)


def _piece_loader(pieces, release):
    """DCP's default load planner (over an empty state dict) reading into the pieces' boxes."""
    import dataclasses

    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
    by_key: dict[str, list] = {}
    for p in pieces:
        by_key.setdefault(p.key, []).append(p)

    class Planner(DefaultLoadPlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for key, ps in by_key.items():
                md = self.metadata.state_dict_metadata.get(key)
                if md is None:
                    raise KeyError(f"the checkpoint has no tensor {key!r}")
                items += create_read_items_for_chunk_list(key, md, [
                    ChunkStorageMetadata(offsets=torch.Size(p.offsets), sizes=p.data.shape)
                    for p in ps])
            return dataclasses.replace(plan, items=[*plan.items, *items])

        def lookup_tensor(self, index):
            return by_key[index.fqn][index.index].data   # the local chunk's position

        def commit_tensor(self, read_item, tensor) -> None:
            p = by_key[read_item.dest_index.fqn][read_item.dest_index.index]
            if release is not None and p.owner is not None:
                release([p.owner], True)
    return Planner()


def new_save_group(group: Group):
    """A gloo process group of ``group``'s members for background saves, so that DCP's own
    collectives in the writer thread never interleave with the training's on ``group`` (None for
    a world of one). Collective over ``group``: every member calls it, once per run."""
    if group.pg is None:
        return None
    import torch.distributed as dist
    return dist.new_group(list(group.ranks), backend="gloo")


def save_async(state: dict, folder: str, save_group):
    """Start writing ``state`` into ``folder`` in DCP's writer thread (``async_save``: the
    tensors are staged, copied, before it returns, so training may change the originals);
    returns a Future that is done when this rank's part is (on the coordinator, rank 0 of the
    group: when the whole folder is, .metadata included). ``save_group``: new_save_group's."""
    import torch.distributed.checkpoint as dcp
    if save_group is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return dcp.async_save(state, checkpoint_id=folder, storage_writer=_writer(folder),
                                  no_dist=True)
    return dcp.async_save(state, checkpoint_id=folder, storage_writer=_writer(folder),
                          process_group=save_group)


def load(template: dict, folder: str, group: Group | None) -> dict:
    """Fill ``template`` (keys to read: tensors to copy into, objects to replace) from ``folder``;
    returns it. ``group`` None (or of size one): this process reads alone."""
    import torch.distributed.checkpoint as dcp
    if group is None or group.pg is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(template, checkpoint_id=folder, no_dist=True)
    else:
        dcp.load(template, checkpoint_id=folder, process_group=group.pg)
    return template


def stored(folder: str) -> dict:
    """{key: (shape, dtype)} of every stored tensor, and {key: None} of every stored object."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = FileSystemReader(folder).read_metadata()
    return {k: ((tuple(v.size), v.properties.dtype) if isinstance(v, TensorStorageMetadata)
                else None) for k, v in meta.state_dict_metadata.items()}


def read_tensors(folder: str, prefix: str) -> dict[str, torch.Tensor]:
    """Every stored tensor whose key starts with ``prefix``, whole, read by this process alone
    (prefix stripped from the keys)."""
    template = {k: torch.empty(shape, dtype=dtype) for k, v in stored(folder).items()
                if v is not None and k.startswith(prefix) for shape, dtype in [v]}
    if not template:
        return {}
    load(template, folder, None)
    return {k[len(prefix):]: t for k, t in template.items()}


def read_keys(folder: str, shapes: dict[str, tuple]) -> dict[str, torch.Tensor]:
    """The stored tensors ``shapes`` names ({key: (shape, dtype)}, as :func:`stored` gives),
    whole, read by this process alone into tensors allocated here: only those keys' bytes are
    read (DCP stages one stored tensor at a time while it copies it in)."""
    template = {k: torch.empty(shape, dtype=dtype) for k, (shape, dtype) in shapes.items()}
    return load(template, folder, None) if template else {}


def read_object(folder: str, key: str, group: Group | None):
    """One stored object (saved as a BytesIO of torch.save), unpickled with its tensors on the
    CPU, wherever they were saved (a CUDA run's state read by a CPU run, or on a machine with
    fewer GPUs, must not touch CUDA); loading copies them onto the run's device."""
    out = load({key: io.BytesIO()}, folder, group)[key]
    out.seek(0)
    return torch.load(out, map_location="cpu", weights_only=False)


def as_bytes(obj) -> io.BytesIO:
    """An object DCP stores as opaque bytes (torch.save into memory)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return buf
