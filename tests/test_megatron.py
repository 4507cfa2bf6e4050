"""Megatron-core's DistributedDataParallel with the giftcomm process group as its data-parallel
group, run for real over gloo at P = 2 (torchrun-style spawned ranks): with and without the
distributed optimizer, overlap on and off, its gradient buffers after ``finish_grad_sync`` match
the same run on a plain gloo group within e4m3's bound and agree bit for bit across ranks.

Test-only shim (never in the library): ``torch.cuda.current_device`` returns "cpu", where
Megatron allocates its gradient buffers.
"""
from __future__ import annotations

import torch
from test_torchrun import _spawn

CONFIGS = [(False, False), (False, True), (True, False), (True, True)]  # (distributed optimizer, overlap)


def _grads(rank, dp, one, dopt, overlap):
    """The reduced part of every gradient buffer after 2 steps of SGD-on-main_grad (all-reduce
    mode) or gradient steps (distributed optimizer: this rank's shards), and the losses."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.distributed.param_and_grad_buffer import shard_buffer
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer import TransformerConfig

    pgc = ProcessGroupCollection(dp=dp, tp=one, pp=one, ep=one, expt_dp=one)
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
            out.append(torch.cat([shard_buffer(b.grad_data, 2)[rank].clone() for buf in ddp.buffers for b in buf.buckets]))
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


def test_megatron_ddp_trains_with_the_giftcomm_group(tmp_path):
    res = _spawn(_worker, 2, tmp_path)
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
