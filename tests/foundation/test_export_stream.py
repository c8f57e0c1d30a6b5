"""``shardwise checkpoint export CKPT OUT``, streamed (shardwise/checkpoint/export.py): the files
load back equal to the checkpoint's tensors (one file, one model.safetensors, shards with an
index), an hf:gpt2 export loads with ``from_pretrained`` and gives the same logits, the export
holds at most one group of ``--max-shard-size`` bytes (plus one tensor) at once, and a full
disk ends with one line and leaves the earlier export as it was.

The checkpoints come from one-step runs on one process (the layouts' own checkpoint tests are
tests/parallel/test_checkpoint_layouts.py). Every comparison is exact: export copies bytes.
"""
import errno
import json
import os
import weakref
from dataclasses import replace

import pytest
import torch

from reference import tiny_config
from shardwise import cli
from shardwise.checkpoint import canonical, dcp_io, export, tools
from shardwise.models import build_model
from shardwise.run.runtime import init_runtime
from shardwise.run.train import train

pytestmark = pytest.mark.timeout(240)


def _checkpoint(root, run: str, **model) -> str:
    """A one-step run's checkpoint folder (``model``: ModelConfig fields to change)."""
    cfg = tiny_config("single", steps=1)
    cfg = replace(cfg, model=replace(cfg.model, **model),
                  train=replace(cfg.train, checkpoint_dir=f"{root}/{run}"),
                  logging=replace(cfg.logging, out_dir=root, run_name=run))
    train(cfg, init_runtime(cfg), quiet=True)["engine"].close()
    return f"{root}/{run}"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """A GPT of 6 layers (87 tensors, tok_emb and head tied) and an hf:gpt2 of 2 layers."""
    root = str(tmp_path_factory.mktemp("export"))
    return {"gpt": _checkpoint(root, "gpt", n_layer=6),
            "hf": _checkpoint(root, "hf", name="hf:gpt2")}


def _expected(ck: str) -> dict:
    """The plain model's state dict the checkpoint holds (read whole, the old way)."""
    folder = tools.find(ck)
    from shardwise.config import from_dict
    from shardwise.checkpoint import store
    cfg = from_dict(store.read_meta(folder)["config"])
    with torch.device("meta"):
        model = build_model(cfg.model, 0)
    return canonical.plain_state_dict(model, dcp_io.read_tensors(folder, canonical.MODEL))


def _load_folder(out) -> dict:
    from safetensors.torch import load_file
    single = os.path.join(out, export.SINGLE)
    if os.path.exists(single):
        return load_file(single)
    with open(os.path.join(out, export.INDEX)) as fh:
        index = json.load(fh)
    got = {}
    for f in sorted(set(index["weight_map"].values())):
        part = load_file(os.path.join(out, f))
        assert all(index["weight_map"][k] == f for k in part), f
        got.update(part)
    assert index["metadata"]["total_size"] == sum(t.nbytes for t in got.values())
    return got


def _equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


def test_round_trip_single_sharded_and_file(ckpts, tmp_path, capsys):
    from safetensors.torch import load_file
    want = _expected(ckpts["gpt"])
    out = str(tmp_path / "out")
    assert cli.main(["checkpoint", "export", ckpts["gpt"], out]) == 0
    assert sorted(os.listdir(out)) == [export.SINGLE]
    _equal(_load_folder(out), want)
    # sharded: 16 KB shards; each shard holds at most that, unless one tensor alone is larger
    assert cli.main(["checkpoint", "export", ckpts["gpt"], out, "--max-shard-size", "16KB"]) == 0
    shards = sorted(f for f in os.listdir(out) if f != export.INDEX)
    assert len(shards) > 5 and export.SINGLE not in shards       # the old single file is gone
    for f in shards:
        part = load_file(os.path.join(out, f))
        assert sum(t.nbytes for t in part.values()) <= 16_000 or len(part) == 1, f
    _equal(_load_folder(out), want)
    # back to one file: the shards and the index of the sharded export are removed
    assert cli.main(["checkpoint", "export", ckpts["gpt"], out]) == 0
    assert sorted(os.listdir(out)) == [export.SINGLE]
    # one named file (the old form, --out): whatever its size, read in 16 KB groups
    path = str(tmp_path / "m.safetensors")
    assert cli.main(["checkpoint", "export", ckpts["gpt"], "--out", path,
                     "--max-shard-size", "16KB"]) == 0
    _equal(load_file(path), want)
    model = build_model(replace(tiny_config().model, n_layer=6), seed=5)   # other weights
    model.load_state_dict(load_file(path))                     # strict: every name and shape
    capsys.readouterr()


def test_hf_gpt2_sharded_export_loads_with_from_pretrained(ckpts, tmp_path):
    import transformers
    out = str(tmp_path / "hf")
    assert cli.main(["checkpoint", "export", ckpts["hf"], out, "--max-shard-size", "20KB"]) == 0
    assert os.path.exists(os.path.join(out, export.INDEX))
    assert os.path.exists(os.path.join(out, "config.json"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight      # still tied
    # the reference: the run's own model class with the checkpoint's tensors
    from shardwise.config import from_dict
    from shardwise.checkpoint import store
    cfg = from_dict(store.read_meta(tools.find(ckpts["hf"]))["config"])
    ref = build_model(cfg.model, 99)
    canonical.load_model(ref, dcp_io.read_tensors(tools.find(ckpts["hf"]), canonical.MODEL))
    ref.eval()
    x = torch.randint(0, cfg.model.vocab_size, (3, cfg.model.block_size),
                      generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        # the same class, the same weights, the same input on one thread: the same arithmetic
        torch.testing.assert_close(loaded(x).logits, ref(x).logits, rtol=0, atol=0)


@pytest.mark.parametrize("target", ["o", "o.safetensors"])
def test_export_holds_one_group_at_a_time(ckpts, tmp_path, monkeypatch, target):
    """The loader is instrumented: each tensor it hands out is counted until it is freed; at
    every read, the bytes alive (earlier groups not yet freed, plus this group) must stay
    within one group: at most --max-shard-size bytes, or one tensor larger than that. Into a
    folder (shards of that size) and into one file (the whole model, read group by group)."""
    budget = 16_000
    live = {"bytes": 0, "peak": 0, "reads": 0}
    read = tools._read_model

    def counted(folder, stored, keys):
        got = read(folder, stored, keys)
        for t in got.values():
            live["bytes"] += t.nbytes
            weakref.finalize(t, _sub, live, t.nbytes)          # counted down when freed
        live["peak"] = max(live["peak"], live["bytes"])
        live["reads"] += 1
        return got

    monkeypatch.setattr(tools, "_read_model", counted)
    done = tools.export(ckpts["gpt"], str(tmp_path / target), budget)
    want = _expected(ckpts["gpt"])
    total = sum(t.nbytes for t in want.values())
    largest = max(t.nbytes for t in want.values())
    assert total > 20 * budget and live["reads"] > 10, (total, live)
    assert live["peak"] <= max(budget, largest), (live, budget, largest)
    assert live["bytes"] == 0                                    # nothing kept after the export
    assert len(done["tensors"]) == len(want)


def _sub(live: dict, n: int) -> None:
    live["bytes"] -= n


def _snapshot(folder) -> dict:
    return {f: open(os.path.join(folder, f), "rb").read() for f in sorted(os.listdir(folder))}


@pytest.mark.parametrize("target", ["folder", "file"])
def test_full_disk_leaves_the_earlier_export(ckpts, tmp_path, monkeypatch, capsys, target):
    out = str(tmp_path / "out") if target == "folder" else str(tmp_path / "m.safetensors")
    assert cli.main(["checkpoint", "export", ckpts["gpt"], out, "--max-shard-size", "64KB"]) == 0
    folder = out if target == "folder" else str(tmp_path)
    before = _snapshot(folder)
    capsys.readouterr()
    calls = {"n": 0}
    write = export._write_tensor

    def full(fh, t):                       # the disk fills up after 20 tensors
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        write(fh, t)

    monkeypatch.setattr(export, "_write_tensor", full)
    # into shards of another size: other file names than the earlier export's
    code = cli.main(["checkpoint", "export", ckpts["gpt"], out, "--max-shard-size", "16KB"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and err.startswith("error: "), err
    assert "disk is full" in err and out in err and "fix:" in err, err
    assert calls["n"] > 20
    assert _snapshot(folder) == before                         # unchanged, no temporary files


def test_too_little_room_is_refused_before_writing(ckpts, tmp_path, monkeypatch, capsys):
    import collections
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(export.shutil, "disk_usage", lambda p: usage(10**6, 10**6 - 100, 100))
    out = str(tmp_path / "out")
    assert cli.main(["checkpoint", "export", ckpts["gpt"], out]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "bytes on its filesystem, which has 100 free" in err
    assert os.listdir(out) == []


@pytest.mark.parametrize("text, size", [("2GB", 2 * 10**9), ("500MiB", 500 * 2**20),
                                        ("123", 123), ("1.5kb", 1500)])
def test_sizes(text, size):
    assert export.parse_size(text) == size


def test_bad_export_arguments_are_one_line(ckpts, tmp_path, capsys):
    for argv in (["checkpoint", "export", ckpts["gpt"]],
                 ["checkpoint", "export", ckpts["gpt"], str(tmp_path), "--out", str(tmp_path)],
                 ["checkpoint", "export", ckpts["gpt"], str(tmp_path), "--max-shard-size", "0"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith("error: ") and "fix:" in err, err
