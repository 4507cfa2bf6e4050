"""The DDP hook's device route driven on the CPU, GiftState's validation, the None-state error.

The device route is the one CUDA buckets take: stream-ordered, over a GROUPED transport, on the
calling thread, with no host copy. Here a DeviceLoopbackGroup (NCCL's group semantics, threads
as ranks) carries CPU torch tensors standing in for device memory, and torch's host-copy methods
are patched to raise while the hook runs, so a bucket that reached a host copy fails the test.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

from giftcomm.adapters.torch import GiftState, gift_hook
from giftcomm.adapters.torch.kfac import KfacCapture
from giftcomm.reference import simulate_allreduce
from giftcomm.transport.device_loopback import DeviceLoopbackGroup

torch.set_num_threads(1)


class FakeBucket:
    """What gift_hook reads of a dist.GradBucket."""

    def __init__(self, buf: torch.Tensor, index: int = 0, last: bool = True, params=()) -> None:
        self.buf, self.i, self.last, self.params = buf, index, last, list(params)

    def buffer(self) -> torch.Tensor:
        return self.buf

    def index(self) -> int:
        return self.i

    def is_last(self) -> bool:
        return self.last

    def parameters(self):
        return self.params

    def gradients(self):
        out, off = [], 0
        for p in self.params:
            out.append(self.buf[off: off + p.numel()].view(p.shape))
            off += p.numel()
        return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("P", [2, 3])
def test_device_route_grouped_no_host_copy(rng, dtype, P, monkeypatch):
    n = int(rng.integers(1000, 5000))
    xs = [torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype) for _ in range(P)]
    group = DeviceLoopbackGroup(P)
    states = group.run(lambda t: GiftState(transport=t))
    buffers = [x.clone() for x in xs]

    def rank_fn(t):
        fut = gift_hook(states[t.rank], FakeBucket(buffers[t.rank]))
        assert isinstance(fut, torch.futures.Future)
        return fut.wait()

    with monkeypatch.context() as m:  # every rank's hook runs with host copies refused
        for name in ("cpu", "numpy", "to", "tolist", "item"):
            m.setattr(torch.Tensor, name, _refuse(name))
        outs = group.run(rank_fn)
    for st in states:
        s = st.stats()
        assert s.device_buckets == 1 and s.host_buckets == 0 and st.iter == 1
        assert s.bytes_in == n * xs[0].element_size() and s.bytes_wire < s.bytes_in
        st.shutdown()
    ref = simulate_allreduce([x.float().numpy() for x in xs], "e4m3", 256, "avg")[0]
    expect = torch.from_numpy(ref).to(dtype)
    for r in range(P):
        assert outs[r].data_ptr() == buffers[r].data_ptr(), "the bucket is reduced in place"
        assert torch.equal(outs[r], expect), f"rank {r}: device route != reference simulation"


def _refuse(name):
    def method(self, *args, **kwargs):
        raise AssertionError(f"the device route called torch.Tensor.{name}")
    return method


def test_device_route_reduced_geometry_builds_off_the_hook(rng):
    """geometry="reduced" on the device route: estimator fed on the geometry thread, the rebuild
    adopted at iteration r + 1 + rebuild_lag on every rank, identical geometries."""
    P, shapes = 2, [(24, 16), (16,), (8, 24)]
    params = [torch.nn.Parameter(torch.zeros(s)) for s in shapes]
    names = {p: f"w{i}" for i, p in enumerate(params)}
    n = sum(p.numel() for p in params)
    group = DeviceLoopbackGroup(P)
    from giftcomm.geometry import SelectivePolicy

    pol = SelectivePolicy(min_size=0, min_gain=0.0, flops_per_gain=1e9)
    states = group.run(lambda t: GiftState(transport=t, geometry="reduced", estimate_every=1, refresh_every=2,
                                           rebuild_lag=1, policy=pol, param_names=names))
    used = {r: [] for r in range(P)}

    def rank_fn(t):
        st = states[t.rank]
        for it in range(6):
            x = torch.from_numpy(np.random.default_rng([it, t.rank]).standard_normal(n).astype(np.float32))
            gift_hook(st, FakeBucket(x, params=params)).wait()
            g = st.geometry_of(0)
            used[t.rank].append(None if g is None else g.fingerprint())
        st.shutdown()

    group.run(rank_fn)
    assert used[0] == used[1]
    # rebuilt from iteration 1 -> adopted at 3, from iteration 3 -> adopted at 5
    assert used[0][:3] == [None] * 3 and used[0][3] is not None and used[0][5] != used[0][3]
    s = states[0].stats()
    assert s.rebuilds == 3 and s.estimator_updates == 6 and s.transformed_segments > 0


def test_gift_state_validates_at_construction():
    group = DeviceLoopbackGroup(1)
    t = group.transports[0]
    with pytest.raises(ValueError, match="fp8"):
        GiftState(transport=t, fmt="fp8")
    with pytest.raises(ValueError):
        GiftState(transport=t, block=0)
    with pytest.raises(ValueError, match="geometry"):
        GiftState(transport=t, geometry="kfca")
    with pytest.raises(ValueError, match="capture"):
        GiftState(transport=t, geometry="kfac")
    with pytest.raises(ValueError, match="refresh_every"):
        GiftState(transport=t, refresh_every=0)
    with pytest.raises(ValueError, match="damping"):
        GiftState(transport=t, damping=-1.0)
    with pytest.raises(TypeError, match="param_names"):
        GiftState(transport=t, param_names=42)
    with pytest.raises(TypeError, match="transport"):
        GiftState(transport=object())
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    st = GiftState(transport=t, param_names=model)  # a module names the segments
    assert sorted(st.param_names.values()) == ["0.bias", "0.weight"]
    st.shutdown()


def test_hook_with_none_state_says_what_to_do():
    with pytest.raises(TypeError, match="GiftState"):
        gift_hook(None, FakeBucket(torch.zeros(4)))


def test_kfac_capture_warns_on_multihead_attention():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = torch.nn.MultiheadAttention(8, 2)
            self.mlp = torch.nn.Linear(8, 8)

        def forward(self, x):
            return self.mlp(self.attn(x, x, x)[0])

    model = Block()
    with pytest.warns(RuntimeWarning, match="MultiheadAttention"):
        cap = KfacCapture(model, every=1)
    assert "attn.in_proj_weight" in cap.uncaptured and "attn.out_proj.weight" in cap.uncaptured
    assert list(cap.layers.values()) == ["mlp.weight"]  # out_proj's hook would never fire
    cap.step(0)
    model(torch.randn(5, 3, 8)).sum().backward()
    assert cap.silent_layers() == []
