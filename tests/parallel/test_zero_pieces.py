"""The pieces under ZeRO, without a world: flat layouts and shards, storage release, offload."""
import pytest
import torch

from shardwise.comm.flat import (FlatLayout, alloc_storage, free_storage,
                                 storage_bytes)
from shardwise.memory.offload import OffloadStore, prefill_adam_state
from shardwise.parallel.data.zero_stage3 import split_units
from shardwise.models.gpt import GPT, GPTConfig


def test_layout_pads_to_world_and_round_trips():
    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 2)]   # 26 elements
    layout = FlatLayout.of(tensors, world=4)
    assert (layout.numel, layout.padded, layout.shard_numel) == (26, 28, 7)
    flat = layout.new_flat(tensors)
    assert flat[26:].eq(0).all()
    for view, t in zip(layout.views(flat), tensors):
        assert torch.equal(view, t)
    shards = [layout.shard(flat, r) for r in range(4)]
    assert torch.equal(torch.cat(shards), flat)
    assert shards[1].data_ptr() == flat.data_ptr() + 7 * flat.element_size()


def test_free_and_alloc_storage_keep_views_alive():
    flat = torch.arange(6.0)
    view = flat[2:4]
    free_storage(flat)
    assert storage_bytes(flat) == 0
    alloc_storage(flat)
    flat.copy_(torch.arange(6.0) * 10)
    assert view.tolist() == [20.0, 30.0]


def test_disk_store_is_memory_mapped_and_leaves_nothing(tmp_path):
    store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    p = torch.nn.Parameter(store.zeros(10))
    opt = torch.optim.Adam([p], lr=0.1)
    prefill_adam_state(opt, store)
    p.grad = torch.ones(10)
    opt.step()                                       # Adam's first step moves by -lr
    store.release([p, *[v for v in opt.state[p].values() if v.dim()]])
    assert all(store.owns(v) for v in opt.state[p].values() if v.dim())
    assert torch.allclose(p.detach(), torch.full((10,), -0.1))   # readable after release
    assert store.mapped_bytes == store.held_bytes() == 3 * 10 * 4  # master + two moments
    assert not list(tmp_path.iterdir())              # files unlinked once mapped


def test_gpt_units_are_blocks_and_edges():
    model = GPT(GPTConfig(n_layer=2, n_embd=16, n_head=2, block_size=8, vocab_size=11))
    units = split_units(model)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m, _ in units] == ["tok_emb", "pos_emb", "blocks.0", "blocks.1",
                                                "ln_f", "head"]
    assert sum(len(ps) for _, ps in units) == len(list(model.parameters()))


def test_units_by_policy_nested_tied_and_frozen():
    from models_hf import tiny_gpt2
    from shardwise.parallel.data.zero_stage3 import block_class
    model = tiny_gpt2(0)
    model.transformer.wpe.weight.requires_grad_(False)
    assert block_class(model) == "GPT2Block"          # found below transformer.h, not a child
    units = split_units(model, trainable_only=True)
    names = {id(m): n for n, m in model.named_modules()}
    assert [names[id(m)] for m, _ in units] == ["", "transformer.h.0", "transformer.h.1",
                                                "transformer.ln_f"]
    assert units[0][1] == [model.transformer.wte.weight]   # tied with lm_head: the root's
    every = [p for _, ps in units for p in ps]
    assert len(every) == len({id(p) for p in every}) == len(list(model.parameters())) - 1
    mlp = split_units(model, ["GPT2MLP"])
    assert sum(type(m).__name__ == "GPT2MLP" for m, _ in mlp) == 2
    try:
        split_units(model, ["NoSuchBlock"])
    except ValueError as exc:
        assert "zero3_units" in str(exc)
    else:
        raise AssertionError("an unknown unit class must be refused")


def test_shard_runs_cut_groups_to_each_shard():
    from shardwise.comm.flat import shard_runs
    tensors = [torch.zeros(5), torch.zeros(4), torch.zeros(3)]   # groups 0, 0, 1; 12 -> 12
    layout = FlatLayout.of(tensors, world=4)                       # shards of 3
    runs = [shard_runs(layout, [0, 0, 1], r) for r in range(4)]
    assert runs == [[(0, 0, 3)], [(0, 0, 3)], [(0, 0, 3)], [(1, 0, 3)]]
    odd = FlatLayout.of([torch.zeros(4), torch.zeros(3)], world=2)   # 7 -> 8, shards of 4
    assert [shard_runs(odd, ["a", "b"], r) for r in range(2)] == [[("a", 0, 4)], [("b", 0, 4)]]
    mixed = FlatLayout.of([torch.zeros(3), torch.zeros(3)], world=2)  # shards of 3: a | b
    assert shard_runs(mixed, ["a", "b"], 0) == [("a", 0, 3)]
    assert shard_runs(FlatLayout.of([torch.zeros(2), torch.zeros(4)], 2), ["a", "b"], 0) == \
        [("a", 0, 2), ("b", 2, 3)]


def test_ddp_and_zero_buckets_come_from_one_planner():
    """DDP's gradient buckets and ZeRO-1/2's chunks hold the same parameters, last layers first."""
    import shardwise
    from shardwise.config import Config, ParallelConfig
    plans = {}
    for strategy in ("ddp", "zero1", "zero2"):
        torch.manual_seed(0)
        model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=8, vocab_size=64))
        names = {id(p): n for n, p in model.named_parameters()}
        cfg = Config(parallel=ParallelConfig(strategy=strategy, bucket_mb=0.01))
        engine = shardwise.prepare(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3), cfg)
        s = engine.strategy
        groups = s.buckets.buckets if strategy == "ddp" else s.chunks
        plans[strategy] = [[names[id(p)] for p in g.params] for g in groups]
        last = list(names.values())[-1]
    assert len(plans["ddp"]) > 2
    assert plans["ddp"] == plans["zero1"] == plans["zero2"]
    assert plans["ddp"][0][0] == last          # the last registered parameter fills first


def test_disk_store_holds_any_dtype_and_pages_round_trip(tmp_path):
    """Any dtype in a file (bf16 parameter shards under --offload-params); a tensor written,
    written back and dropped on the store's thread, then read in again, keeps its values."""
    store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    a, b = store.zeros(5000), store.zeros(7, torch.bfloat16)
    a.copy_(torch.arange(5000.0))
    b.fill_(1.5)
    store.release([a, b])
    store.prefetch([a])
    store.drain()
    assert torch.equal(a, torch.arange(5000.0)) and b.tolist() == [1.5] * 7
    assert store.mapped_bytes == 5000 * 4 + 7 * 2
    store.close()
    assert torch.equal(a, torch.arange(5000.0))        # still mapped while the tensor lives


def test_disk_store_refuses_a_full_disk_naming_the_file(tmp_path, monkeypatch):
    """Blocks are reserved when a tensor is made: a filesystem without room refuses there, an
    OffloadIOError naming the file (never a SIGBUS on a later write into a hole)."""
    import errno
    import os
    from shardwise.memory.offload_io import OffloadIOError

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(os, "posix_fallocate", full)
    store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    with pytest.raises(OffloadIOError) as exc:
        store.zeros(1000)
    assert exc.value.errno == errno.ENOSPC and str(tmp_path) in exc.value.filename
    assert not list(tmp_path.iterdir())


def test_a_failed_write_back_surfaces_on_the_training_thread_as_one_line(tmp_path):
    """A failed page operation (here: an address no mapping starts at, EINVAL) is raised on
    the training thread as an OffloadIOError naming the file (a job of the writer thread: by
    the next call, or drain); ranks.resource_error turns it into one line."""
    from types import SimpleNamespace
    from shardwise.launch.ranks import resource_error
    from shardwise.memory.offload_io import DiskIO, OffloadIOError, Region
    io = DiskIO()
    bad = Region(mapping=None, address=1, length=4096, path=str(tmp_path / "state.bin"))
    with pytest.raises(OffloadIOError) as exc:  # madvise / msync of an unaligned address
        io.write_back([bad])
        io.drain()
    io.close()
    line = resource_error(exc.value, SimpleNamespace(logging=SimpleNamespace(out_dir="runs"),
                                                     memory=SimpleNamespace(offload="disk")))
    assert line and "\n" not in line and str(tmp_path / "state.bin") in line and "fix:" in line


def test_a_failed_background_write_is_raised_by_drain(tmp_path, monkeypatch):
    """The writer thread's failure (a full or broken disk at msync) waits for the training
    thread's next call: drain raises it, naming the file."""
    import errno
    from shardwise.memory import offload_io

    def broken(regions):
        raise offload_io.OffloadIOError(errno.EIO, "offload=disk: writing failed (I/O error)",
                                        regions[0].path)
    monkeypatch.setattr(offload_io, "sync", broken)
    store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    t = store.zeros(100)
    t.fill_(3.0)
    store.release([t])                      # dropped at once; the write fails in the background
    with pytest.raises(offload_io.OffloadIOError) as exc:
        store.drain()
    assert exc.value.errno == errno.EIO and "shardwise-rank0-" in exc.value.filename
    assert t.sum().item() == 300.0          # the data stayed in the file's pages


def test_offload_sync_auto_syncs_only_a_state_beyond_a_quarter_of_memory():
    from shardwise.memory.offload_io import sync_needed
    gib = 2**30
    assert sync_needed("auto", 7 * gib, available=24 * gib) is True        # 3.2B-like state
    assert sync_needed("auto", 1 * gib, available=24 * gib) is False       # 57M-like state
    assert sync_needed("always", 1, available=24 * gib) is True
    assert sync_needed("kernel", 100 * gib, available=24 * gib) is False
    with pytest.raises(ValueError, match="one of auto, always, kernel"):
        sync_needed("sometimes", 1)


def test_left_to_the_kernel_a_written_chunk_is_dropped_but_not_synced(tmp_path, monkeypatch):
    """``kernel``: write_back drops the pages from the process (resident memory falls as with
    ``always``) and asks the writer for nothing; the data stays in the file's pages."""
    from shardwise.memory import offload_io
    calls = []
    monkeypatch.setattr(offload_io, "sync", lambda regions: calls.append(len(regions)))
    for setting, synced in (("always", [1]), ("kernel", [])):
        calls.clear()
        store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
        store.plan_writes(setting, 1)
        t = store.zeros(1000)
        t.fill_(2.0)
        store.release([t])
        store.drain()
        assert calls == synced and store.syncs is (setting == "always")
        assert t.sum().item() == 2000.0
        store.close()


def test_zero3_offload_params_sync_settings_train_bit_identically(tmp_path):
    """The run's decision is reported by the store, and where writes reach the disk changes
    nothing the training computes: ZeRO-3 with parameters on disk, always against kernel."""
    from harness import run_world
    outs = [run_world(_offload_sync_run, 2, setting, str(tmp_path / setting), timeout=180)
            for setting in ("always", "kernel")]
    assert [o[0]["syncs"] for o in outs] == [True, False]
    assert outs[0][0]["losses"] == outs[1][0]["losses"]
    for a, b in zip(outs[0][0]["params"], outs[1][0]["params"]):
        assert torch.equal(a, b)


def _offload_sync_run(rank, world, setting, folder):
    from dataclasses import replace
    from shardwise.bench.harness import gpt_bench_config
    from shardwise.data import build_data
    from shardwise.models import build_model, lm_loss
    from shardwise.run.api import optimizer_factory
    import shardwise
    cfg = gpt_bench_config("zero3")
    cfg = replace(cfg, memory=replace(cfg.memory, offload="disk", offload_params=True,
                                      offload_dir=folder, offload_sync=setting),
                  model=replace(cfg.model, n_layer=2, n_embd=64, n_head=2))
    data = build_data(cfg)
    engine = shardwise.prepare(build_model(cfg.model, 0), optimizer_factory(cfg), cfg,
                               loss_fn=lm_loss)
    losses = [engine.train_step(*engine.shard(*data.batch(i, 8, 0, 1))) for i in range(3)]
    params = [p.detach().clone() for p in engine.full_state_dict().values()]
    syncs = engine.strategy.store.syncs
    engine.close()
    return {"losses": losses, "params": params, "syncs": syncs}


def test_a_late_read_ahead_does_not_map_a_released_chunk_again(tmp_path):
    """The reader thread lags the training thread on a busy machine: a read-ahead of a chunk
    still queued when the chunk is released must not run after the release, else it maps the
    chunk's pages into the process again, resident until its next use (at 57M they were up to
    two chunks' state, 100 MiB of a rank's peak). Before the fix: RssFile +32 MiB here."""
    import threading
    from shardwise.memory import offload_io

    def rss_file() -> int:
        with open("/proc/self/status") as fh:
            return next(int(l.split()[1]) * 1024 for l in fh if l.startswith("RssFile:"))
    store = OffloadStore("disk", torch.device("cpu"), str(tmp_path))
    store.plan_writes("kernel", 1)
    chunks = [store.zeros(4 << 20) for _ in range(2)]           # 16 MiB each
    store.release(chunks)
    gate = threading.Event()
    store.io._reader.submit(lambda regions: gate.wait(30), [])  # the reader is busy
    store.prefetch(chunks)                                      # queued behind it
    before = rss_file()
    store.release(chunks)                                       # done with before it ran
    gate.set()
    store.drain()
    assert rss_file() - before < 2 << 20, (rss_file() - before) >> 20
    # a read-ahead already running is waited for, then dropped: still nothing resident
    store.io._reader.submit(offload_io.populate, [store._maps[c.data_ptr()] for c in chunks])
    store.release(chunks)
    store.drain()
    assert rss_file() - before < 2 << 20
    chunks[0].fill_(1.0)                                        # the data path still works
    store.release(chunks)
    assert chunks[0].sum().item() == 4 << 20
    store.close()
