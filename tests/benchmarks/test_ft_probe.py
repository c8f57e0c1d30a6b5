"""bench/ft_probe.py's accounting, on made-up run folders whose answers are worked out here: steps
lost (a step taken twice, a step missing, a rejoin behind its own last step, a step no group
took), steps completed, kills matched to their rejoins, restarts no kill caused, and the table.
The runs themselves (minutes of training with a killer) belong to the benchmark."""
import json
import os

from shardwise.bench import ft_probe as fp

T0 = 1000.0


def write_run(root, groups: dict[int, dict], kept: dict[str, list[int]]) -> str:
    """A run folder as a --ft-replicas run leaves it: per group ft.jsonl (rank 0's events, and a
    rank 1 line the reader must ignore) and metrics.jsonl (one record per step), plus the
    killer's kept metrics of killed processes in probe/."""
    run = os.path.join(str(root), "run")
    for g, spec in groups.items():
        os.makedirs(os.path.join(run, f"replica{g}"))
        with open(os.path.join(run, f"replica{g}", "ft.jsonl"), "w") as fh:
            for e in spec["events"]:
                fh.write(json.dumps({"group": g, "rank": 0, **e}) + "\n")
            fh.write(json.dumps({"event": "start", "group": g, "rank": 1, "pid": 1,
                                 "time": T0, "step": 0, "restart": 9}) + "\n")
        write_metrics(os.path.join(run, f"replica{g}", "metrics.jsonl"), spec["steps"])
    os.makedirs(os.path.join(run, "probe"))
    for name, steps in kept.items():
        write_metrics(os.path.join(run, "probe", name), steps)
    return run


def write_metrics(path: str, steps: list[int]) -> None:
    with open(path, "w") as fh:
        for s in steps:
            fh.write(json.dumps({"step": s, "loss": 1.0, "step_seconds": 2.5 if s == 51 else 0.3})
                     + "\n")
        fh.write('{"step": 9')          # a torn last line (the file is being written)


def life(pid, restart, join, t):
    return [{"event": "start", "pid": pid, "time": t, "step": 0, "restart": restart},
            {"event": "join", "pid": pid, "time": t + 0.5, "step": join, "members": [0, 1, 2]}]


def clean_run(tmp_path, survivor_steps=None, rejoin=50):
    """Group 2 killed after step 50 (its process 30 kept steps 1..50), restarted as process 31,
    rejoined at ``rejoin``; groups 0 and 1 never killed."""
    full = list(range(1, 101))
    groups = {0: {"events": life(10, 0, 0, T0), "steps": survivor_steps or full},
              1: {"events": life(20, 0, 0, T0), "steps": full},
              2: {"events": life(30, 0, 0, T0) + life(31, 1, rejoin, T0 + 60),
                  "steps": list(range(rejoin + 1, 101))}}
    run = write_run(tmp_path, groups, {"replica2.life0.metrics.jsonl": list(range(1, 51))})
    kills = [{"target": 50, "group": 2, "pid": 30, "time": T0 + 58, "step_seen": 50,
              "live": [0, 1, 2], "kept": "replica2.life0.metrics.jsonl"}]
    return run, kills


def account(run, kills, steps=100):
    return fp.account(steps, fp.load_groups(run, kills), kills)


def test_a_clean_kill_and_rejoin_loses_nothing(tmp_path):
    run, kills = clean_run(tmp_path)
    acc = account(run, kills)
    assert acc["completed"] == {0: 100, 1: 100, 2: 100}
    assert acc["steps_lost"] == 0 and acc["uncovered"] == 0
    assert acc["restarts"] == {0: 0, 1: 0, 2: 1} and acc["unexplained_restarts"] == 0
    (k,) = acc["kills"]
    assert (k["rejoin_step"], k["rejoin_seconds"], k["stall_seconds"]) == (50, 2.5, 2.5)
    # the away interval is not lost: group 2 rejoins at 60, the others took 51..60
    run, kills = clean_run(tmp_path / "later", rejoin=60)
    acc = account(run, kills)
    assert acc["steps_lost"] == 0 and acc["kills"][0]["rejoin_step"] == 60


def test_a_step_taken_twice_or_missing_is_lost(tmp_path):
    twice = list(range(1, 41)) + list(range(38, 101))     # steps 38-40 again: 3 lost
    run, kills = clean_run(tmp_path / "twice", survivor_steps=twice)
    acc = account(run, kills)
    assert acc["lost"] == {0: 3, 1: 0, 2: 0} and acc["steps_lost"] == 3
    gap = [s for s in range(1, 101) if s not in (70, 71)]   # 2 steps missing
    run, kills = clean_run(tmp_path / "gap", survivor_steps=gap)
    assert account(run, kills)["steps_lost"] == 2


def test_a_rejoin_behind_its_own_last_step_is_lost(tmp_path):
    run, kills = clean_run(tmp_path, rejoin=45)           # steps 46..50 taken again by group 2
    acc = account(run, kills)
    assert acc["lost"] == {0: 0, 1: 0, 2: 5} and acc["kills"][0]["rejoin_step"] == 45


def test_a_step_no_group_took_is_lost_and_a_short_group_is_not_completed(tmp_path):
    short = list(range(1, 91))
    groups = {g: {"events": life(10 + g, 0, 0, T0),
                  "steps": [s for s in short if s != 60]} for g in range(3)}
    groups[0]["steps"] = list(range(1, 101))
    groups[0]["steps"].remove(60)
    run = write_run(tmp_path, groups, {})
    acc = account(run, [])
    assert acc["completed"] == {0: 100, 1: 90, 2: 90}
    assert acc["uncovered"] == 1 and acc["lost"] == {0: 1, 1: 1, 2: 1}
    assert acc["steps_lost"] == 4


def test_a_restart_no_kill_caused_is_counted_apart(tmp_path):
    run, kills = clean_run(tmp_path)
    events = fp.read_events(run, 1)
    with open(os.path.join(run, "replica1", "ft.jsonl"), "a") as fh:
        for e in life(21, 1, 80, T0 + 90):
            fh.write(json.dumps({"group": 1, "rank": 0, **e}) + "\n")
    write_metrics(os.path.join(run, "replica1", "metrics.jsonl"), list(range(81, 101)))
    acc = account(run, kills)
    assert len(events) == 2 and acc["unexplained_restarts"] == 1
    assert acc["restarts"][1] == 1 and acc["steps_lost"] == 0


def test_the_newest_life_is_live_only_after_its_join_and_a_step(tmp_path):
    run, _ = clean_run(tmp_path)
    with open(os.path.join(run, "replica2", "ft.jsonl"), "a") as fh:
        fh.write(json.dumps({"event": "start", "group": 2, "rank": 0, "pid": 32, "time": T0 + 99,
                             "step": 0, "restart": 2}) + "\n")
    now = fp.newest_life(run, 2)
    assert (now["pid"], now["joined"], now["last"], now["life"]) == (32, None, None, 2)
    old = fp.newest_life(run, 0)
    assert (old["pid"], old["joined"], old["last"]) == (10, 0, 100)
    assert fp.alive(os.getpid()) and not fp.alive(2 ** 22 + 1)    # above pid_max: no process


def test_table_and_summary(tmp_path):
    run, kills = clean_run(tmp_path)
    acc = account(run, kills)
    runs = [{"side": "kills", "rep": 0, "tokens_per_s": 900.0, "train_seconds": 10.0,
             "wall_seconds": 12.0, "bit_identical": True, "rejoins": 1, "weights_sha256": "a",
             **{k: v for k, v in acc.items() if k != "rejoins"}},
            {"side": "no kills", "rep": 0, "tokens_per_s": 1000.0, "train_seconds": 9.0,
             "wall_seconds": 11.0, "bit_identical": True, "rejoins": 0, "weights_sha256": "a",
             "completed":
             {0: 100, 1: 100, 2: 100}, "steps_lost": 0, "kills": []}]
    res = {"runs": runs, "figures": fp.summarize(runs)}
    assert res["figures"]["ratio"] == 0.9 and res["figures"]["kills"] == 1
    text = fp.table(res)
    assert "| kills 1 | 100 / 100 / 100 | 0 | 50: g2 -> 50 (2.5; 2.5) | 10.0 | 900 |" in text
    assert "| no kills 1 | 100 / 100 / 100 | 0 | - |" in text
    assert "0.900 (medians; 0.900 to 0.900" in text and "1 kills, 1 rejoins, 0 steps lost" in text
    assert "0 steps taken by the survivors without" in text and text.rstrip().endswith(": yes.")
    runs[0]["weights_sha256"], runs[0]["kills"][0]["rejoin_step"] = "b", 53
    f = fp.summarize(runs)
    assert f["same_weights_as_no_kills"] is False and f["steps_without_a_group"] == 3


def test_final_weights_digest_tells_runs_apart(tmp_path):
    import torch
    from safetensors.torch import save_file
    digests = []
    for name, value in (("a", 1.0), ("b", 1.0), ("c", 1.5)):
        run = tmp_path / name
        for g in range(fp.GROUPS):
            (run / f"replica{g}").mkdir(parents=True)
            save_file({"w": torch.full((3,), value + (g == 2 and name == "c"))},
                      str(run / f"replica{g}" / "final.safetensors"))
        digests.append(fp.final_weights(str(run)))
    assert digests[0] == digests[1] and digests[0][0] is True
    assert digests[2][0] is False and digests[2][1] != digests[0][1]
