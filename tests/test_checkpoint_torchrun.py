"""GiftState checkpoints under torchrun (gloo, P = 2): the pickled state holds the same bytes on
every rank at an iteration boundary, and a fresh job restored from it continues exactly like the
uninterrupted run (the saved estimators, geometries and not yet adopted rebuilds are used)."""
from __future__ import annotations

import pickle

import torch
from test_torchrun import _mlp, _spawn  # noqa: E402  (one spawn-and-rendezvous helper for torchrun tests)

from giftcomm import GiftSchedule

STEPS, SAVE_AT = 9, 6  # rebuilds at iterations 2, 5, 8 (refresh_every=3), adopted 2 later (rebuild_lag=1)


def _train(rank, world, seed, ckpt_dir, resume):
    import torch.distributed as dist  # noqa: F401  (initialised by the spawn helper)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from giftcomm.adapters.torch import GiftState
    from giftcomm.geometry import SelectivePolicy

    model = _mlp(seed, torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    path = f"{ckpt_dir}/rank{rank}.pt"
    if resume:
        with open(path, "rb") as f:
            saved = pickle.load(f)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        state = pickle.loads(saved["gift"])  # collective: makes its private groups again
        first = saved["step"]
        assert state.iter == first
    else:
        pol = SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9)
        state = GiftState(fmt="e4m3", schedule=GiftSchedule(geometry="reduced", estimate_every=1, refresh_every=3,
                          rebuild_lag=1, warmup=1, policy=pol), param_names=model)
        first = 0
    # find_unused_parameters: DDP keeps its initial buckets (it never rebuilds them in the gradients'
    # ready order after the first iteration), so the resumed job's buckets are the uninterrupted run's
    ddp = DDP(model, bucket_cap_mb=0.01, find_unused_parameters=True)
    state.register(ddp)
    out: dict = {"steps": {}}
    for step in range(first, STEPS):
        if step == SAVE_AT and not resume:
            blob = pickle.dumps(state)
            out["gift_blob"] = blob
            with open(path, "wb") as f:
                pickle.dump({"model": model.state_dict(), "opt": opt.state_dict(), "gift": blob, "step": step}, f)
        gen = torch.Generator().manual_seed(seed * 1000 + 10 * step + rank)
        x = torch.randn(32, 24, generator=gen)
        opt.zero_grad(set_to_none=False)
        ddp(x).pow(2).mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().tobytes()
        opt.step()
        params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).numpy().tobytes()
        out["steps"][step] = (grads, params)
    out["transformed"] = any(state.geometry_of(i) is not None and not state.geometry_of(i).is_identity
                             for i in range(16))
    state.shutdown()
    return out


def test_a_restored_gift_state_continues_like_the_uninterrupted_run(tmp_path, rng):
    world, seed = 2, int(rng.integers(2**20))
    full = _spawn(_train, world, str(tmp_path), seed, str(tmp_path), False)
    assert full[0]["gift_blob"] == full[1]["gift_blob"], "the checkpoint differs between ranks"
    assert full[0]["transformed"], "no geometry transformed a segment: the test would not exercise GIFT"
    assert all(full[0]["steps"][s] == full[1]["steps"][s] for s in range(STEPS)), "ranks hold different models"
    resumed = _spawn(_train, world, str(tmp_path), seed, str(tmp_path), True)
    for r in range(world):
        assert sorted(resumed[r]["steps"]) == list(range(SAVE_AT, STEPS))
        for s in range(SAVE_AT, STEPS):
            assert resumed[r]["steps"][s] == full[r]["steps"][s], f"rank {r} step {s}: not the uninterrupted run's"
