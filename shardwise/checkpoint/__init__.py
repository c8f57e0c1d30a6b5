"""Checkpoints: save from every layout, resume exactly, reshard into another layout, export.

    store.py      the folder: step-N/ sub-folders, meta.json, an atomic 'latest', keep K
    dcp_io.py     the one door to torch.distributed.checkpoint (explicit group)
    state.py      what a checkpoint holds; save; plan_resume / restore_model / restore
    canonical.py  the layout-free form (model and optimizer state by parameter name)
    pieces.py     that form written a box per rank (ZeRO with disk offload: nothing gathered)
    checks.py     refusals before launch (one line, exit 2)
    stop.py       SIGINT / SIGTERM with checkpointing on: save at the step boundary, then stop
    tools.py      ``shardwise checkpoint inspect | export``

train.py drives it: ``plan_resume`` -> ``restore_model`` (reshard: into the plain model) ->
``prepare`` -> ``restore`` -> the loop, with ``save`` every ``train.checkpoint_every`` steps, at
the end, and on a stop.
"""

__all__ = ["ResumePlan", "plan_resume", "restore", "restore_model", "save"]


def __getattr__(name: str):
    """``checkpoint.save`` and the others, from state.py on first use: the package itself (store,
    checks) is imported by the launcher, which must not pay torch's import to check flags."""
    if name in __all__:
        from shardwise.checkpoint import state
        return getattr(state, name)
    raise AttributeError(f"module 'shardwise.checkpoint' has no attribute {name!r}")
