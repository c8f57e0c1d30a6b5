"""The mesh's groups and coordinates, and the comm layer's results and meter, in real worlds."""
import pytest
import torch

from harness import run_world
from shardwise.comm.collectives import Comm, Group
from shardwise.mesh import Mesh, axis_members, coords_of, rank_of

pytestmark = pytest.mark.timeout(180)


def test_rank_layout_is_tp_innermost_pp_outermost():
    # pp=2, dp=2, tp=2: tp neighbours differ by 1, dp by tp, pp by dp*tp
    assert coords_of(5, dp=2, tp=2) == (1, 0, 1)
    for r in range(8):
        assert rank_of(*coords_of(r, 2, 2), dp=2, tp=2) == r
    assert axis_members("tp", 2, 2, 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert axis_members("dp", 2, 2, 2) == [(0, 2), (1, 3), (4, 6), (5, 7)]
    assert axis_members("pp", 2, 2, 2) == [(0, 4), (1, 5), (2, 6), (3, 7)]


def _mesh_checks(rank, n):
    mesh = Mesh.build(pp=2, dp=1, tp=2)
    comm = Comm()
    # allreduce over tp: the members' global ranks summed
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, mesh.tp_group)
    tp_sum = float(t)
    # all_gather over pp
    out = torch.empty(2)
    comm.all_gather(out, torch.tensor([float(rank)]), mesh.pp_group)
    # reduce_scatter over world, avg
    rs = torch.empty(2)
    comm.reduce_scatter(rs, torch.arange(8, dtype=torch.float32) + rank, mesh.world, op="avg")
    # broadcast from pp member 1
    b = torch.tensor([float(rank)])
    comm.broadcast(b, 1, mesh.pp_group)
    # send/recv between pipeline neighbours
    x = torch.tensor([float(rank) * 10])
    if mesh.is_first_stage:
        comm.send(x, mesh.next_stage, mesh.pp_group)
        got = None
    else:
        got = torch.empty(1)
        comm.recv(got, mesh.prev_stage, mesh.pp_group)
        got = float(got)
    return dict(coords=mesh.coords, tp_sum=tp_sum, gathered=out.tolist(), rs=rs.tolist(),
                bcast=float(b), got=got, meter=comm.meter.snapshot(),
                first=mesh.is_first_stage, last=mesh.is_last_stage)


def test_mesh_groups_and_collectives_world4():
    res = run_world(_mesh_checks, 4)
    for rank, r in enumerate(res):
        pp_rank, dp_rank, tp_rank = coords_of(rank, 1, 2)
        assert r["coords"] == (pp_rank, dp_rank, tp_rank)
        tp_members = [pp_rank * 2, pp_rank * 2 + 1]
        assert r["tp_sum"] == sum(tp_members)
        assert r["gathered"] == [float(tp_rank), float(2 + tp_rank)]
        expect = [(sum(range(4)) / 4) + v for v in (2 * rank, 2 * rank + 1)]
        assert r["rs"] == pytest.approx(expect)
        assert r["bcast"] == float(2 + tp_rank)
        assert r["first"] == (pp_rank == 0) and r["last"] == (pp_rank == 1)
        if pp_rank == 1:
            assert r["got"] == float(tp_rank * 10)
        # meter: allreduce of 4 bytes in a group of 2 moves 2(N-1)/N*K = 4 bytes each way
        assert r["meter"]["all_reduce"]["bytes_sent"] == 4
        assert r["meter"]["reduce_scatter"]["bytes_sent"] == int(3 / 4 * 32)
        assert r["meter"]["all_gather"]["calls"] == 1


def test_solo_group_short_circuits():
    comm = Comm()
    t = torch.tensor([3.0])
    comm.all_reduce(t, Group.solo(), op="avg")
    out = torch.empty(1)
    comm.all_gather(out, t, Group.solo())
    assert float(t) == 3.0 and float(out) == 3.0
    assert comm.meter.snapshot() == {}


def test_named_axes_in_any_order_lay_ranks_out_row_major():
    """The mesh is a name -> size mapping; the order given is the layout (last innermost), so a
    mesh built in another order puts different ranks together, and code that assumed the old
    order would meet different groups."""
    from shardwise.mesh import coords_in, groups_along, rank_in
    classic = {"pp": 2, "dp": 2, "tp": 2}
    swapped = {"tp": 2, "dp": 2, "pp": 2}             # pp innermost now
    assert groups_along("tp", classic) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert groups_along("tp", swapped) == [(0, 4), (1, 5), (2, 6), (3, 7)]
    assert groups_along("pp", swapped) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    four = {"pp": 2, "dp_replicate": 2, "dp_shard": 2, "tp": 2}   # a later axis: one more entry
    for r in range(16):
        assert rank_in(coords_in(r, four), four) == r
    assert coords_in(13, four) == {"pp": 1, "dp_replicate": 1, "dp_shard": 0, "tp": 1}
    assert groups_along("dp_shard", four)[0] == (0, 2)


def test_a_mesh_without_an_axis_answers_size_one():
    mesh = Mesh.solo()
    assert (mesh.size("cp"), mesh.coord("cp"), mesh.group("cp").size) == (1, 0, 1)
    assert mesh.world_size == 1 and mesh.coords == (0, 0, 0)


def _named_mesh(rank, n):
    mesh = Mesh.from_sizes({"dp": 2, "tp": 2})        # no pp axis at all
    comm = Comm()
    t = torch.tensor([float(rank)])
    comm.all_reduce(t, mesh.group("dp"))
    return dict(dp=mesh.dp_rank, tp=mesh.tp_rank, pp=mesh.pp, dp_sum=float(t),
                text=mesh.describe())


def test_mesh_from_named_sizes_world4():
    res = run_world(_named_mesh, 4)
    for rank, r in enumerate(res):
        assert (r["dp"], r["tp"], r["pp"]) == (rank // 2, rank % 2, 1)
        assert r["dp_sum"] == float((rank % 2) + (rank % 2 + 2))
    assert res[3]["text"] == "rank 3/4 at (dp=1, tp=1) of mesh dp=2 x tp=2"
