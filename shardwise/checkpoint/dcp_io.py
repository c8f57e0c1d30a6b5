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


def save(state: dict, folder: str, group: Group) -> None:
    """Write ``state`` (a flat dict of tensors and objects) into ``folder`` from every rank."""
    import torch.distributed.checkpoint as dcp
    if group.pg is None:
        with warnings.catch_warnings():     # "assuming ... a single process": it is one
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(state, checkpoint_id=folder, storage_writer=_writer(folder), no_dist=True)
    else:
        dcp.save(state, checkpoint_id=folder, storage_writer=_writer(folder),
                 process_group=group.pg)


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
