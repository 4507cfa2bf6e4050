"""The giftcomm process group (giftcomm.adapters.torch.new_group), run for real over gloo at P = 2
with torchrun-style spawned ranks: every compressed collective equals the reference simulation
bit for bit on every rank; what the policy leaves alone equals the inner group's own result;
bad input fails on every rank; DDP(process_group=pg) trains with it (no comm hook).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from conftest import UNKNOWN_FORMAT
from test_torchrun import _spawn

from giftcomm.reference import simulate_allgather, simulate_allreduce, simulate_reduce_scatter

N = 3001  # a multiple of no block


def _data(rank, n, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g).to(dtype)


def _collectives_worker(rank, world):
    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=1000)
    res: dict = {"rank": dist.get_rank(pg), "size": dist.get_world_size(pg), "backend": dist.get_backend(pg)}
    # its name as torch registered it (DeviceMesh.from_group reads pg.group_name: FSDP2 over the group)
    res["name"] = (pg.group_name, dist.distributed_c10d._world.pg_names[pg])
    x = _data(rank, N)
    res["x"] = x.clone()
    y = x.clone()
    res["work_done"] = dist.all_reduce(y, group=pg, async_op=True).wait()
    res["allreduce"] = y
    y = x.clone()
    dist.all_reduce(y, op=dist.ReduceOp.AVG, group=pg)
    res["avg"] = y
    y = x.clone()
    dist.all_reduce(y, op=dist._make_nccl_premul_sum(0.25), group=pg)
    res["premul"] = y
    # reduce-scatter (equal layout) of a (P, n) stack, and a coalesced block of two
    inp = _data(rank, 2 * 1500, seed=1)
    out = torch.empty(1500)
    dist.reduce_scatter_tensor(out, inp, group=pg)
    res["rs_in"], res["rs"] = inp, out
    a, b = x.clone(), _data(rank, 1200, seed=2)
    res["coal_in"] = torch.cat([a, b])
    with dist._coalescing_manager(pg, async_ops=True) as cm:
        dist.all_reduce(a, group=pg)
        dist.all_reduce(b, group=pg)
    cm.wait()
    res["coal"] = torch.cat([a, b])
    i1, i2 = _data(rank, 2 * 700, seed=3), _data(rank, 2 * 900, seed=4)
    o1, o2 = torch.empty(700), torch.empty(900)
    with dist._coalescing_manager(pg):
        dist.reduce_scatter_tensor(o1, i1, group=pg)
        dist.reduce_scatter_tensor(o2, i2, group=pg)
    res["rsc_in"], res["rsc"] = (i1, i2), (o1, o2)
    gift_calls = pg.counts["giftcomm"]
    # left to the inner group: ints, small tensors, MAX, broadcast, barrier, all-gather
    ints = torch.arange(5000) * (rank + 1)
    dist.all_reduce(ints, group=pg)
    small = _data(rank, 999, seed=5)
    dist.all_reduce(small, group=pg)
    mx = x.clone()
    dist.all_reduce(mx, op=dist.ReduceOp.MAX, group=pg)
    bc = x.clone()
    dist.broadcast(bc, group_src=0, group=pg)
    dist.barrier(group=pg)
    gathered = torch.empty(2 * N)
    dist.all_gather_into_tensor(gathered, x, group=pg)
    res["plain"] = (ints, small, mx, bc, gathered)
    res["gift_calls"] = (gift_calls, pg.counts["giftcomm"], pg.counts["inner"])
    # bad input: a tensor factor PREMUL_SUM goes to gloo, which refuses it (on every rank)
    try:
        dist.all_reduce(x.clone(), op=dist._make_nccl_premul_sum(torch.tensor(0.5)), group=pg)
        res["tensor_premul"] = None
    except Exception as exc:  # noqa: BLE001
        res["tensor_premul"] = type(exc).__name__
    return res


def test_collectives_match_the_reference_bit_for_bit(tmp_path):
    import torch.distributed as dist

    res = _spawn(_collectives_worker, 2, tmp_path)
    xs = [r["x"].numpy() for r in res]
    want = simulate_allreduce(xs, fmt="e4m3", algorithm="ring")
    avg = simulate_allreduce(xs, fmt="e4m3", algorithm="ring", op="avg")
    for r in range(2):
        got = res[r]
        assert (got["rank"], got["size"], got["backend"]) == (r, 2, "giftcomm")
        assert got["name"][0] == got["name"][1] != ""
        assert got["work_done"] is True
        np.testing.assert_array_equal(got["allreduce"].numpy(), want[r])
        assert not np.array_equal(got["allreduce"].numpy(), xs[0] + xs[1])  # it really was compressed
        np.testing.assert_array_equal(got["avg"].numpy(), avg[r])
        np.testing.assert_array_equal(got["premul"].numpy(), want[r] * np.float32(0.25))
        rs = simulate_reduce_scatter([x["rs_in"].numpy() for x in res], fmt="e4m3", layout="equal")
        np.testing.assert_array_equal(got["rs"].numpy(), rs[r])
        coal = simulate_allreduce([x["coal_in"].numpy() for x in res], fmt="e4m3", algorithm="ring")
        np.testing.assert_array_equal(got["coal"].numpy(), coal[r])
        # the coalesced reduce-scatter: each input's rank-r chunk, laid out rank by rank, in one call
        rows = [np.concatenate([i.numpy().reshape(2, -1) for i in x["rsc_in"]], axis=1).reshape(-1) for x in res]
        shard = simulate_reduce_scatter(rows, fmt="e4m3", layout="equal")[r]
        np.testing.assert_array_equal(np.concatenate([o.numpy() for o in got["rsc"]]), shard)
        assert got["gift_calls"][0] == 6 and got["gift_calls"][1] == 6  # nothing below went through giftcomm
        ints, small, mx, bc, gathered = got["plain"]
        assert torch.equal(ints, torch.arange(5000) * 3)
        s = [_data(q, 999, seed=5) for q in range(2)]
        assert torch.equal(small, s[0] + s[1])
        assert torch.equal(mx, torch.maximum(res[0]["x"], res[1]["x"]))
        assert torch.equal(bc, res[0]["x"]) and torch.equal(gathered, torch.cat([res[0]["x"], res[1]["x"]]))
        assert got["tensor_premul"] is not None
    assert dist.ReduceOp.PREMUL_SUM  # the op exists in this torch


def _disagree_worker(rank, world):
    from giftcomm.adapters.torch import new_group

    try:
        new_group(fmt="e4m3" if rank == 0 else "e5m2")
    except ValueError as exc:
        return str(exc)
    return None


def _routes_worker(rank, world):
    """Calls on which the ranks' own policies would take different routes, or agree on giftcomm
    with different calls: each must raise the same ValueError on every rank, and the group must
    stay usable (the good call after them)."""
    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=1000)
    gathers = new_group(fmt="e4m3", algorithm="ring", min_elems=1000, allgather=True)
    x = _data(rank, 2 * N)
    t = x[: 2 * N if rank == 0 else 998]  # below min_elems on rank 1 only

    def bad_coalesced():
        a, b = x[:1500].clone(), x[1500:].clone()
        if rank == 1:
            b = b.double()  # a coalesced call mixing dtypes on one rank
        with dist._coalescing_manager(pg):
            dist.all_reduce(a, group=pg)
            dist.all_reduce(b, group=pg)

    def bad_gather():  # a compressed all-gather (allgather=True) of float32 on rank 0, float16 on rank 1
        dtype = torch.float32 if rank == 0 else torch.float16
        dist.all_gather_into_tensor(torch.empty(2 * N, dtype=dtype), x[:N].clone().to(dtype), group=gathers)

    cases = {
        "small_on_one": lambda: dist.all_reduce(t.clone(), group=pg),
        "dtype": lambda: dist.all_reduce(x.clone().to(torch.float64 if rank else torch.float32), group=pg),
        "int_on_one": lambda: dist.all_reduce(x.clone() if rank == 0 else torch.arange(2 * N), group=pg),
        "op": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.SUM if rank == 0 else dist.ReduceOp.MAX, group=pg),
        "factor": lambda: dist.all_reduce(x.clone(), op=dist._make_nccl_premul_sum(0.5 + rank), group=pg),
        "sizes": lambda: dist.all_reduce(x[: 2 * N - rank].clone(), group=pg),
        "strided": lambda: dist.all_reduce(x.view(2, N).t() if rank else x.clone(), group=pg),
        # rank 1's input is float64 into a float32 output: its policy leaves the call to gloo
        "rs_dtype": lambda: dist.reduce_scatter_tensor(torch.empty(N), x.clone() if rank == 0 else x.clone().double(),
                                                       group=pg),
        "coalesced_dtypes": bad_coalesced,
        "allgather_dtype": bad_gather,
    }
    res = {}
    for name, call in cases.items():
        try:
            call()
            res[name] = None
        except ValueError as exc:
            res[name] = str(exc)
    y = x.clone()
    dist.all_reduce(y, group=pg)
    return res, x, y, dict(pg.counts)


def test_ranks_on_different_routes_all_raise(tmp_path):
    res = _spawn(_routes_worker, 2, tmp_path)
    for name in res[0][0]:
        msgs = [r[0][name] for r in res]
        assert all(m is not None and "disagree" in m for m in msgs), (name, msgs)
        assert msgs[0] == msgs[1], name  # the same error on every rank
    assert "inner group" in res[0][0]["small_on_one"] and "giftcomm" in res[0][0]["small_on_one"]
    assert "float64" in res[0][0]["dtype"] and "6001 elements" in res[0][0]["sizes"]
    # the group is still in step: the next call is giftcomm's, bit for bit the reference on both ranks
    want = simulate_allreduce([r[1].numpy() for r in res], fmt="e4m3", algorithm="ring")
    for r in range(2):
        np.testing.assert_array_equal(res[r][2].numpy(), want[r])
        assert res[r][3]["giftcomm"] == 1  # none of the bad calls ran on either route


def _queued_worker(rank, world):
    """Three asynchronous all-reduces issued back to back, before any wait (queued on the group's
    worker thread): the middle one has another size on rank 1. Returns each wait's outcome."""
    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=1000)
    x = _data(rank, 2 * N, seed=5)
    first, bad, last = x[:N].clone(), x[: N - rank].clone(), x[N:].clone()
    works = [dist.all_reduce(t, group=pg, async_op=True) for t in (first, bad, last)]
    outcomes = []
    for w in works:
        try:
            outcomes.append(("ok", w.wait()))
        except ValueError as exc:
            outcomes.append(("ValueError", str(exc)))
    return outcomes, x, first, last, dict(pg.counts)


def test_queued_calls_raise_a_mismatch_on_every_rank(tmp_path):
    """A mismatched call among queued asynchronous ones raises the same ValueError from every
    rank's wait() (no hang); the calls before and after it are giftcomm's, bit for bit."""
    res = _spawn(_queued_worker, 2, tmp_path)
    for r in range(2):
        outcomes = res[r][0]
        assert outcomes[0] == ("ok", True) and outcomes[2] == ("ok", True), outcomes
        assert outcomes[1][0] == "ValueError" and "disagree" in outcomes[1][1]
        assert outcomes[1] == res[0][0][1]  # the same error on every rank
        assert res[r][4]["giftcomm"] == 2
    for k, part in ((2, slice(0, N)), (3, slice(N, 2 * N))):
        want = simulate_allreduce([res[q][1][part].numpy() for q in range(2)], fmt="e4m3", algorithm="ring")
        for r in range(2):
            np.testing.assert_array_equal(res[r][k].numpy(), want[r])


def test_ranks_disagreeing_on_options_all_raise(tmp_path):
    res = _spawn(_disagree_worker, 2, tmp_path)
    assert all(r is not None and "disagree" in r for r in res)


DP = ([0, 2], [1, 3])  # world 4 under tensor parallelism 2: the data-parallel groups


def _subgroups_worker(rank, world):
    """Giftcomm groups over the data-parallel subsets :data:`DP`, every rank calling new_group
    for each (the Megatron pattern), after an ordinary group over rank 1 alone (the ranks then
    hold different numbers of groups); then a whole-world giftcomm group, an ordinary group,
    subset groups whose members disagree on the options, and one more subset group."""
    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    none = dist.GroupMember.NON_GROUP_MEMBER
    dist.new_group(ranks=[1])
    groups = [new_group(ranks=dp, fmt="e4m3", algorithm="ring", min_elems=1000, allgather=True) for dp in DP]
    res: dict = {"member": [g != none for g in groups]}
    pg = groups[rank % 2]
    res["group"] = (dist.get_rank(pg), dist.get_world_size(pg), dist.get_process_group_ranks(pg), pg.size())
    x = _data(rank, N)
    res["x"] = x.clone()
    y = x.clone()
    dist.all_reduce(y, group=pg)
    res["allreduce"] = y
    inp = _data(rank, 2 * 1500, seed=1)
    out = torch.empty(1500)
    dist.reduce_scatter_tensor(out, inp, group=pg)
    res["rs_in"], res["rs"] = inp, out
    gathered = torch.empty(2 * N)
    dist.all_gather_into_tensor(gathered, x, group=pg)
    res["allgather"] = gathered
    a, b = x.clone(), _data(rank, 1200, seed=2)
    res["coal_in"] = torch.cat([a, b])
    with dist._coalescing_manager(pg):
        dist.all_reduce(a, group=pg)
        dist.all_reduce(b, group=pg)
    res["coal"] = torch.cat([a, b])
    res["counts"] = dict(pg.counts)
    whole = new_group(fmt="e4m3", algorithm="ring", min_elems=1000)
    y = x.clone()
    dist.all_reduce(y, group=whole)
    res["whole"] = y
    ints = torch.arange(7) * (rank + 1)
    dist.all_reduce(ints, group=dist.new_group())
    res["plain"] = ints
    res["disagree"] = []
    for dp in DP:  # group rank 0 asks for e4m3, group rank 1 for e5m2
        try:
            g = new_group(ranks=dp, fmt="e4m3" if rank < 2 else "e5m2")
            res["disagree"].append("non-member" if g == none else "made")
        except ValueError as exc:
            res["disagree"].append(str(exc))
    last = new_group(ranks=[0, 1], fmt="e4m3", algorithm="ring", min_elems=1000)
    y = x.clone()
    if last != none:
        dist.all_reduce(y, group=last)
    res["last"] = y
    return res


def test_groups_over_subsets_of_the_ranks(tmp_path):
    res = _spawn(_subgroups_worker, 4, tmp_path)
    xs = [r["x"].numpy() for r in res]
    for dp in DP:
        want = simulate_allreduce([xs[q] for q in dp], fmt="e4m3", algorithm="ring")
        rs = simulate_reduce_scatter([res[q]["rs_in"].numpy() for q in dp], fmt="e4m3", layout="equal")
        gathered = simulate_allgather([xs[q] for q in dp], fmt="e4m3")
        coal = simulate_allreduce([res[q]["coal_in"].numpy() for q in dp], fmt="e4m3", algorithm="ring")
        for i, q in enumerate(dp):
            got = res[q]
            assert got["member"] == [q in d for d in DP]  # NON_GROUP_MEMBER on the other group's ranks
            assert got["group"] == (i, 2, dp, 2)
            np.testing.assert_array_equal(got["allreduce"].numpy(), want[i])
            np.testing.assert_array_equal(got["rs"].numpy(), rs[i])
            np.testing.assert_array_equal(got["allgather"].numpy(), gathered[i])
            np.testing.assert_array_equal(got["coal"].numpy(), coal[i])
            assert got["counts"] == {"giftcomm": 4, "inner": 0}
            # group rank 0 gave e4m3, group rank 1 e5m2: ValueError on both members, nothing elsewhere
            for d, msg in zip(DP, got["disagree"]):
                assert ("disagree" in msg) if q in d else msg == "non-member", (q, msg)
        assert not np.array_equal(res[dp[0]]["allreduce"].numpy(), xs[dp[0]] + xs[dp[1]])  # compressed
    whole = simulate_allreduce(xs, fmt="e4m3", algorithm="ring")
    pair = simulate_allreduce(xs[:2], fmt="e4m3", algorithm="ring")
    for q in range(4):
        np.testing.assert_array_equal(res[q]["whole"].numpy(), whole[q])
        assert torch.equal(res[q]["plain"], torch.arange(7) * 10)
        np.testing.assert_array_equal(res[q]["last"].numpy(), pair[q] if q < 2 else xs[q])


def test_bad_options_raise_where_given():
    from giftcomm.adapters.torch import Policy, new_group

    with pytest.raises(ValueError, match="fmt|format"):
        new_group(fmt=UNKNOWN_FORMAT)
    with pytest.raises(ValueError, match="min_elems"):
        Policy(min_elems=0)
    with pytest.raises(ValueError, match="ops"):
        Policy(ops=("max",))


def _ddp_run(rank, gift):
    """3 SGD steps of a DDP model over the giftcomm group (``gift``) or the default gloo group."""
    import torch.distributed as dist
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from giftcomm.adapters.torch import new_group

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 32))
    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=4096) if gift else None
    ddp = DDP(model, process_group=pg, bucket_cap_mb=0.05)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    grads, losses = [], []
    for step in range(3):
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)
        opt.zero_grad()
        loss = nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]).clone())
        losses.append(loss.item())
        opt.step()
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return {"grads": grads, "losses": losses, "params": params,
            "counts": dict(pg.counts) if gift else None, "backend": dist.get_backend(ddp.process_group)}


def _ddp_worker(rank, world):
    return {"gift": _ddp_run(rank, True), "plain": _ddp_run(rank, False)}  # one launch, two trainings


def test_ddp_trains_through_the_group_without_a_hook(tmp_path):
    runs = _spawn(_ddp_worker, 2, tmp_path)
    gift, plain = [r["gift"] for r in runs], [r["plain"] for r in runs]
    assert gift[0]["backend"] == "giftcomm" and gift[0]["counts"]["giftcomm"] >= 3
    torch.testing.assert_close(gift[0]["params"], gift[1]["params"], rtol=0, atol=0)  # replicas agree bit for bit
    for step in range(3):
        g, p = gift[0]["grads"][step], plain[0]["grads"][step]
        assert torch.equal(g, gift[1]["grads"][step])
        # e4m3 with per-256-block scales: each value within 2**-3 of its block's max (two ranks' sum)
        assert (g - p).abs().max() <= 0.125 * p.abs().max()
        assert not torch.equal(g, p)
    assert abs(gift[0]["losses"][-1] - plain[0]["losses"][-1]) < 0.05


# ----------------------------------------------------------------------------- what was sent, one agreement
class _Records:
    """The "giftcomm" logger's records in a spawned rank (its warnings)."""

    def __init__(self):
        import logging

        self.messages = []
        handler = logging.Handler()
        handler.emit = lambda record: self.messages.append(record.getMessage())
        logging.getLogger("giftcomm").addHandler(handler)


def _stats_worker(rank, world):
    """Compressed and uncompressed calls on one group, each counted: the agreements per call
    (gathers on the host transport), the warnings, pg.stats(), giftcomm.stats of its transport."""
    import torch.distributed as dist

    import giftcomm
    from giftcomm.adapters.torch import group_stats, new_group

    logs = _Records()
    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=1000)
    host = pg.transport()
    gathers = {"int64": 0, "object": 0}
    gather_int64, gather_object = host.allgather_int64, host.allgather_object

    def count_int64(vec):
        gathers["int64"] += 1
        return gather_int64(vec)

    def count_object(obj):
        gathers["object"] += 1
        return gather_object(obj)

    host.allgather_int64, host.allgather_object = count_int64, count_object
    x = _data(rank, N)
    inp = _data(rank, 2 * 1500, seed=1)
    calls = {
        "allreduce": lambda: dist.all_reduce(x.clone(), group=pg),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(torch.empty(1500), inp, group=pg),
        "small": lambda: dist.all_reduce(_data(rank, 999, seed=5), group=pg),
        "small_again": lambda: dist.all_reduce(_data(rank, 999, seed=6), group=pg),
        "ints": lambda: dist.all_reduce(torch.arange(5000), group=pg),
        "ints_again": lambda: dist.all_reduce(torch.arange(5000), group=pg),
        "max": lambda: dist.all_reduce(x.clone(), op=dist.ReduceOp.MAX, group=pg),
        "broadcast": lambda: dist.broadcast(x.clone(), group_src=0, group=pg),  # not a policy call: no agreement
    }
    agreements, warned = {}, {}
    for name, call in calls.items():
        before, told = gathers["int64"], len(logs.messages)
        call()
        agreements[name] = gathers["int64"] - before
        warned[name] = [m for m in logs.messages[told:] if "UNCOMPRESSED" in m]
    resolved = dist.distributed_c10d._resolve_process_group(pg.group_name)
    return {"agreements": agreements, "objects": gathers["object"], "warned": warned, "stats": pg.stats(),
            "giftcomm": giftcomm.stats(host), "by_handle": group_stats(resolved), "counts": dict(pg.counts)}


def test_stats_warnings_and_one_agreement_per_call(tmp_path):
    from giftcomm.algorithms.partition import chunk_bounds
    from giftcomm.formats import message_nbytes
    from giftcomm.options import CallOptions

    res = _spawn(_stats_worker, 2, tmp_path)
    block = CallOptions(fmt="e4m3").validated().resolved_block
    for rank, got in enumerate(res):
        # one gather of int64 fields per call, whichever route it takes; no object gathers
        assert got["agreements"] == {**dict.fromkeys(got["agreements"], 1), "broadcast": 0}, got["agreements"]
        assert got["objects"] == 0
        # a warning once per group and reason, naming it; the repeats silent but counted
        warned = got["warned"]
        assert not warned["allreduce"] and not warned["reduce_scatter"] and not warned["broadcast"]
        assert len(warned["small"]) == 1 and "below_min_elems" in warned["small"][0] and "999" in warned["small"][0]
        assert len(warned["ints"]) == 1 and "not_float" in warned["ints"][0]
        assert len(warned["max"]) == 1 and "reason op" in warned["max"][0]
        assert not warned["small_again"] and not warned["ints_again"]
        st = got["stats"]
        assert set(st) == {"calls", "bytes_sent", "algorithms", "fallbacks"}
        assert st["calls"] == 7 and st["algorithms"] == {"ring": 2, "inner": 5}
        assert st["fallbacks"] == {"below_min_elems": 2, "not_float": 2, "op": 1}
        # the compressed calls' bytes: the wire messages this rank sends (giftcomm.formats' sizes)
        bounds = chunk_bounds(N, 2, block)
        ring = sum(message_nbytes(int(bounds[c + 1] - bounds[c]), "e4m3", block) for c in range(2))
        scatter = message_nbytes(1500, "e4m3", block)  # the other rank's shard, blocks from its start
        # the inner calls' payload as a ring all-reduce moves it: 2 (P-1)/P of their bytes (two
        # calls of 999 float32, two of 5000 int64, one MAX of N float32)
        native = sum(2 * (2 - 1) * nbytes // 2 for nbytes in (999 * 4, 999 * 4, 5000 * 8, 5000 * 8, N * 4))
        assert st["bytes_sent"] == {"e4m3": ring + scatter, "native": native}, (rank, st)
        assert got["giftcomm"] == st and got["by_handle"] == st  # giftcomm.stats and a torch handle see them
        assert got["counts"] == {"giftcomm": 2, "inner": 6}


def _baseline_worker(rank, world):
    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    pg = new_group(baseline="e5m2/tensor-nccl", min_elems=1000)
    x = _data(rank, N, seed=7)
    y = x.clone()
    dist.all_reduce(y, group=pg)
    avg = x.clone()
    dist.all_reduce(avg, op=dist.ReduceOp.AVG, group=pg)
    half = x.to(torch.bfloat16)
    dist.all_reduce(half, group=pg)
    try:
        dist.reduce_scatter_tensor(torch.empty(1500), _data(rank, 3000), group=pg)
        scatter = None
    except ValueError as exc:
        scatter = str(exc)
    return {"x": x, "sum": y, "avg": avg, "bf16": half, "scatter": scatter, "stats": pg.stats()}


def test_baseline_wire_matches_the_reference_bit_for_bit(tmp_path):
    from giftcomm.reference.baselines import simulate_baseline_allreduce

    res = _spawn(_baseline_worker, 2, tmp_path)
    xs = [r["x"].numpy() for r in res]
    want = simulate_baseline_allreduce(xs, "e5m2/tensor-nccl")
    avg = simulate_baseline_allreduce(xs, "e5m2/tensor-nccl", op="avg")
    bf16 = simulate_baseline_allreduce([r["x"].to(torch.bfloat16).float().numpy() for r in res], "e5m2/tensor-nccl")
    for r, got in enumerate(res):
        np.testing.assert_array_equal(got["sum"].numpy(), want[r])
        np.testing.assert_array_equal(got["avg"].numpy(), avg[r])
        assert torch.equal(got["bf16"], torch.from_numpy(bf16[r]).to(torch.bfloat16))
        assert not np.array_equal(want[r], xs[0] + xs[1])  # FP8 codes really went on the wire
        assert "baseline" in got["scatter"] and got["scatter"] == res[0]["scatter"]  # on every rank alike
        # one FP8 byte per value the ring sends: at P = 2 every value once (half each phase)
        assert got["stats"] == {"calls": 3, "bytes_sent": {"e5m2/tensor-nccl": 3 * N},
                                "algorithms": {"e5m2/tensor-nccl": 3}, "fallbacks": {}}


def _timeout_worker(rank, world):
    """A disagreement raises on both ranks at once; a call rank 1 makes late times out on rank 0
    within giftcomm's call timeout (not the group's 120 s); from then on the group's calls raise
    CommAborted on both ranks."""
    import time

    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group
    from giftcomm.errors import CommAborted, CommTimeout

    limit = 2.0
    pg = new_group(fmt="e4m3", algorithm="ring", min_elems=1000, call_timeout=limit)
    x = _data(rank, N)
    res: dict = {}

    def attempt(call):
        t0 = time.monotonic()
        try:
            call()
            return None, time.monotonic() - t0
        except (ValueError, CommTimeout, CommAborted) as exc:
            return (type(exc).__name__, str(exc)), time.monotonic() - t0

    res["mismatch"] = attempt(lambda: dist.all_reduce(x[: N if rank == 0 else 999].clone(), group=pg))
    res["ok"] = attempt(lambda: dist.all_reduce(x.clone(), group=pg))
    if rank == 1:
        time.sleep(3 * limit)  # rank 0's call waits for this one past its deadline
    res["late"] = attempt(lambda: dist.all_reduce(x.clone(), group=pg))
    dist.barrier()  # the default group: untouched
    res["after"] = attempt(lambda: dist.all_reduce(x.clone(), group=pg))
    res["after_small"] = attempt(lambda: dist.all_reduce(x[:10].clone(), group=pg))
    return res


def test_timeouts_are_giftcomms_and_leave_the_group_aborted(tmp_path):
    res = _spawn(_timeout_worker, 2, tmp_path)
    (m0, t0), (m1, t1) = res[0]["mismatch"], res[1]["mismatch"]
    assert m0 is not None and m0 == m1 and m0[0] == "ValueError" and "disagree" in m0[1]
    assert max(t0, t1) < 2.0  # well within the call timeout
    assert res[0]["ok"][0] is None and res[1]["ok"][0] is None
    late0, waited = res[0]["late"]
    assert late0 is not None and late0[0] == "CommTimeout", late0
    assert 1.5 < waited < 5.0  # giftcomm's 2 s, not the group's 120 s
    late1 = res[1]["late"][0]
    assert late1 is not None and late1[0] in ("CommAborted", "CommTimeout"), late1
    for r in range(2):
        for name in ("after", "after_small"):
            exc, took = res[r][name]
            assert exc is not None and exc[0] == "CommAborted" and "unusable" in exc[1], (r, name, exc)
            assert took < 1.0
