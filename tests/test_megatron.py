"""Megatron-core's DistributedDataParallel with the giftcomm process group as its data-parallel
group, run for real over gloo at P = 2 (torchrun-style spawned ranks): with and without the
distributed optimizer, overlap on and off, its gradient buffers after ``finish_grad_sync`` match
the same run on a plain gloo group within e4m3's bound and agree bit for bit across ranks. At
P = 4 with tensor parallelism 2, one giftcomm group per data-parallel subset ([0, 2], [1, 3]).

Test-only shim (never in the library): ``torch.cuda.current_device`` returns "cpu", where
Megatron allocates its gradient buffers.
"""
from __future__ import annotations

import pytest
import torch
from test_torchrun import _spawn

# one xdist worker runs every test here (--dist loadgroup): the P = 2 launch is made once
pytestmark = pytest.mark.xdist_group("megatron")

CONFIGS = [(False, False), (False, True), (True, False), (True, True)]  # (distributed optimizer, overlap)


def _grads(rank, dp, one, dopt, overlap, tp=None):
    """The reduced part of every gradient buffer after 2 steps of SGD-on-main_grad (all-reduce
    mode) or gradient steps (distributed optimizer: this rank's shards), and the losses.
    ``tp``: the tensor-parallel group (None: ``one``, the rank alone)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    pgc = ProcessGroupCollection(dp=dp, tp=one if tp is None else tp, pp=one, ep=one, expt_dp=one)
    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.Tanh(), torch.nn.Linear(256, 32))
    dcfg = DistributedDataParallelConfig(use_distributed_optimizer=dopt, overlap_grad_reduce=overlap,
                                         bucket_size=10000 if overlap else None)
    ddp = DistributedDataParallel(cfg, dcfg, model, pg_collection=pgc)
    out, losses = [], []
    for step in range(2):
        ddp.zero_grad_buffer()
        g = torch.Generator().manual_seed(10 * step + rank)
        x, y = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        ddp.finish_grad_sync()
        losses.append(loss.item())
        if dopt:
            out.append(torch.cat([shard_buffer(b.grad_data, dp.size())[dp.rank()].clone()
                                  for buf in ddp.buffers for b in buf.buckets]))
        else:
            out.append(torch.cat([buf.grad_data.clone() for buf in ddp.buffers]))
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.main_grad
    return out, losses


def _worker(rank, world):
    import warnings

    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    warnings.simplefilter("ignore")
    torch.cuda.current_device = lambda: "cpu"  # the shim: Megatron's buffers on the CPU
    gift = new_group(fmt="e4m3", algorithm="ring", min_elems=1024)
    plain = dist.new_group()
    one = dist.new_group(ranks=[rank], use_local_synchronization=True)
    res = {c: (_grads(rank, gift, one, *c), _grads(rank, plain, one, *c)) for c in CONFIGS}
    return res, dict(gift.counts)


def _p2_worker(rank, world):
    """Both P = 2 trainings in one launch: Megatron's DDP (every config), then its FSDP2 wrapper."""
    return {"ddp": _worker(rank, world), "fsdp": _fsdp_worker(rank, world)}


@pytest.fixture(scope="module")
def p2(tmp_path_factory):
    return _spawn(_p2_worker, 2, tmp_path_factory.mktemp("megatron-p2"))


def test_megatron_ddp_trains_with_the_giftcomm_group(p2):
    res = [r["ddp"] for r in p2]
    assert res[0][1]["giftcomm"] >= 2 * len(CONFIGS)
    for c in CONFIGS:
        for rank in range(2):
            (gift, gl), (plain, pl) = res[rank][0][c]
            assert abs(gl[0] - pl[0]) < 1e-6  # the same model and data
            for g, p in zip(gift, plain):
                assert (g - p).abs().max() <= 0.125 * p.abs().max(), c  # e4m3: 2**-3 of the amax
                assert not torch.equal(g, p), c  # it went through giftcomm
        if not c[0]:  # all-reduce mode: every rank holds the same reduced buffers, bit for bit
            for a, b in zip(res[0][0][c][0][0], res[1][0][c][0][0]):
                assert torch.equal(a, b)


TP, DP = ([0, 1], [2, 3]), ([0, 2], [1, 3])  # world 4: tensor parallelism 2 x data parallelism 2


def _subsets_worker(rank, world):
    """Megatron's DDP at P = 4 with the data-parallel group a subset of the world: every rank
    makes every tensor-parallel group, every giftcomm data-parallel group and every plain one."""
    import warnings

    import torch.distributed as dist

    from giftcomm.adapters.torch import new_group

    warnings.simplefilter("ignore")
    torch.cuda.current_device = lambda: "cpu"  # the shim: Megatron's buffers on the CPU
    tp = [dist.new_group(ranks=r) for r in TP][rank // 2]
    gift = [new_group(ranks=r, fmt="e4m3", algorithm="ring", min_elems=1024) for r in DP][rank % 2]
    plain = [dist.new_group(ranks=r) for r in DP][rank % 2]
    one = dist.new_group(ranks=[rank], use_local_synchronization=True)
    res = {c: (_grads(rank, gift, one, *c, tp=tp), _grads(rank, plain, one, *c, tp=tp)) for c in SUBSET_CONFIGS}
    return res, dict(gift.counts), dist.get_process_group_ranks(gift)


SUBSET_CONFIGS = [(False, False), (True, False)]


def test_megatron_ddp_with_data_parallel_subsets(tmp_path):
    res = _spawn(_subsets_worker, 4, tmp_path)
    for rank in range(4):
        assert res[rank][2] == DP[rank % 2] and res[rank][1]["giftcomm"] >= 2 * len(SUBSET_CONFIGS)
        for c in SUBSET_CONFIGS:
            (gift, gl), (plain, pl) = res[rank][0][c]
            assert abs(gl[0] - pl[0]) < 1e-6
            for g, p in zip(gift, plain):
                assert (g - p).abs().max() <= 0.125 * p.abs().max(), c  # e4m3: 2**-3 of the amax
                assert not torch.equal(g, p), c
    for c in SUBSET_CONFIGS:
        if not c[0]:  # all-reduce mode: the members of a data-parallel group agree bit for bit, the groups differ
            for a, b in DP:
                assert all(torch.equal(x, y) for x, y in zip(res[a][0][c][0][0], res[b][0][c][0][0]))
            assert not torch.equal(res[0][0][c][0][0][0], res[1][0][c][0][0][0])


def _fsdp_grads(rank, route, gift, plain):
    """The local gradient shards after one backward of Megatron's FSDP2 wrapper over a plain gloo
    group (route "plain"), with giftcomm's FSDP2 comm registered on it afterwards ("register"),
    or over the giftcomm process group ("group"); and the comms' call counts."""
    from megatron.core.distributed import DistributedDataParallelConfig, TorchFullyShardedDataParallel
    from megatron.core.transformer import TransformerConfig

    from giftcomm.adapters.torch import register_reduce_scatter

    cfg = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.Tanh(), torch.nn.Linear(512, 32))
    fsdp = TorchFullyShardedDataParallel(cfg, DistributedDataParallelConfig(), model,
                                         sub_modules_to_wrap={torch.nn.Linear},
                                         process_group=gift if route == "group" else plain)
    comms = register_reduce_scatter(fsdp.module, fmt="e4m3", algorithm="ring") if route == "register" else None
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(16, 64, generator=g), torch.randn(16, 32, generator=g)
    torch.nn.functional.mse_loss(fsdp(x), y).backward()
    grads = [p.grad.to_local().clone() for p in fsdp.module.parameters()]
    return grads, None if comms is None else [c.calls for c in comms]


def _fsdp_worker(rank, world):
    import warnings

    import torch.distributed as dist
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp
    from torch.distributed.device_mesh import DeviceMesh

    from giftcomm.adapters.torch import new_group

    warnings.simplefilter("ignore")

    class _CpuMesh:  # the shim: megatron-core 0.16.1 builds the wrapper's mesh with device type "cuda"
        @staticmethod
        def from_group(group, device_type, *args, **kwargs):
            return DeviceMesh.from_group(group, "cpu", *args, **kwargs)

    tfsdp.DeviceMesh = _CpuMesh
    gift = new_group(fmt="e4m3", algorithm="ring", min_elems=1024)
    plain = dist.new_group()
    res = {route: _fsdp_grads(rank, route, gift, plain) for route in ("plain", "register", "group")}
    return res, dict(gift.counts)


def test_megatron_fsdp2_wrapper_trains_with_giftcomm(p2):
    res = [r["fsdp"] for r in p2]
    for rank in range(2):
        routes, counts = res[rank]
        plain, _ = routes["plain"]
        assert counts["giftcomm"] >= 1  # the group route's large reduce-scatters went through giftcomm
        calls = routes["register"][1]
        assert calls and all(c == 1 for c in calls)  # every FSDP module's comm ran once
        for route in ("register", "group"):
            grads, _ = routes[route]
            assert len(grads) == len(plain) == 4
            for g, p in zip(grads, plain):
                assert (g - p).abs().max() <= 0.125 * p.abs().max(), route  # e4m3: 2**-3 of the amax
            big = [i for i, p in enumerate(plain) if p.numel() >= 1024]
            assert big and all(not torch.equal(grads[i], plain[i]) for i in big), route  # compressed
