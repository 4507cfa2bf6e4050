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
from conftest import UNKNOWN_FORMAT

from giftcomm import GiftSchedule
from giftcomm.accounting import sent_bytes
from giftcomm.adapters.torch import GiftState, gift_hook
from giftcomm.adapters.torch.kfac import KfacCapture
from giftcomm.formats import get_format
from giftcomm.reference import simulate_allreduce
from giftcomm.reference.simulate import resolve_algorithm
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
    for rank, st in enumerate(states):
        s = st.stats()
        assert s.device_buckets == 1 and s.host_buckets == 0 and st.iter == 1
        assert s.bytes_in == n * xs[0].element_size()
        algo = resolve_algorithm("auto", n, P, None, "e4m3")  # stats(): also the dict every adapter's has
        assert dict(s) == {"calls": 1, "algorithms": {algo: 1}, "fallbacks": {},
                           "bytes_sent": {"native" if algo == "native" else "e4m3": sent_bytes(algo, n, P, rank,
                                                                                              get_format("e4m3"), 256)}}
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
    states = group.run(lambda t: GiftState(transport=t, schedule=GiftSchedule(geometry="reduced", estimate_every=1,
                       refresh_every=2, rebuild_lag=1, policy=pol), param_names=names))
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
    with pytest.raises(ValueError, match=UNKNOWN_FORMAT):
        GiftState(transport=t, fmt=UNKNOWN_FORMAT)
    with pytest.raises(ValueError):
        GiftState(transport=t, block=0)
    with pytest.raises(ValueError, match="geometry"):
        GiftState(transport=t, schedule=GiftSchedule(geometry="kfca"))
    with pytest.raises(ValueError, match="capture"):
        GiftState(transport=t, schedule=GiftSchedule(geometry="kfac"))
    with pytest.raises(ValueError, match="refresh_every"):
        GiftState(transport=t, schedule=GiftSchedule(refresh_every=0))
    with pytest.raises(ValueError, match="damping"):
        GiftState(transport=t, schedule=GiftSchedule(damping=-1.0))
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


# ------------------------------------------------------------------ call options, seeds, one rank
def test_gift_state_takes_every_call_option_and_checks_it_at_build():
    from giftcomm.formats import FORMATS, resolve_block

    t = DeviceLoopbackGroup(1).transports[0]
    for name in FORMATS:  # every format builds, with the format's own block
        st = GiftState(transport=t, fmt=name)
        assert st.fmt == name and st.block == resolve_block(name, None) and st.options.op == "avg"
        st.shutdown()
    st = GiftState(transport=t, fmt="nvfp4", rounding="stochastic", seed=5, algorithm="direct", slice_elems=4096,
                   timeout=30)
    assert (st.options.rounding, st.options.seed, st.options.algorithm, st.options.slice_elems,
            st.options.timeout) == ("stochastic", 5, "direct", 4096, 30.0)
    st.shutdown()
    bad = [(dict(fmt="nvfp4", block=256), "fixed block"), (dict(rounding="stochastic", fmt="bf16"), "stochastic"),
           (dict(rounding="up"), "rounding"), (dict(seed=-1), "seed"), (dict(algorithm="rnig"), "algorithm"),
           (dict(slice_elems=0), "slice_elems"), (dict(timeout=float("nan")), "timeout")]
    for kwargs, words in bad:
        with pytest.raises(ValueError, match=words) as err:
            GiftState(transport=t, **kwargs)
        assert str(err.value).startswith("GiftState: "), err.value


def test_step_seed_is_a_fixed_mix_of_seed_step_and_index():
    from giftcomm.adapters.calls import step_seed

    seeds = {step_seed(7, s, i) for s in range(50) for i in range(20)}
    assert len(seeds) == 1000 and all(0 <= v < 1 << 64 for v in seeds)
    assert step_seed(7, 3, 2) == step_seed(7, 3, 2) != step_seed(8, 3, 2)
    assert step_seed(None, 3, 2) == step_seed(0, 3, 2)
    with pytest.raises(ValueError):
        step_seed(1, -1, 0)


@pytest.mark.parametrize("fmt,rounding", [("nvfp4", "stochastic"), ("mxfp8", "nearest")])
def test_hook_uses_the_options_and_derives_per_step_seeds(rng, fmt, rounding):
    """The hook's bucket equals the reference simulation of the state's options; under stochastic
    rounding iteration it of bucket i is rounded with step_seed(seed, it, i)."""
    from giftcomm.adapters.calls import step_seed

    P, n, seed = 2, int(rng.integers(500, 3000)), int(rng.integers(2**40))
    xs = [rng.standard_normal(n).astype(np.float32) for _ in range(P)]
    group = DeviceLoopbackGroup(P)
    states = group.run(lambda t: GiftState(transport=t, fmt=fmt, rounding=rounding, seed=seed, algorithm="direct"))

    def rank_fn(t):
        got = []
        for _ in range(2):
            for i in range(2):
                bucket = FakeBucket(torch.from_numpy(xs[t.rank].copy()), index=i, last=i == 1)
                got.append(gift_hook(states[t.rank], bucket).wait().numpy().copy())
        states[t.rank].shutdown()
        return got

    outs = group.run(rank_fn)
    assert all(np.array_equal(a, b) for a, b in zip(outs[0], outs[1])), "ranks differ"
    k = 0
    for it in range(2):
        for i in range(2):
            s = step_seed(seed, it, i) if rounding == "stochastic" else None
            ref = simulate_allreduce(xs, fmt, None, "avg", algorithm="direct", rounding=rounding, seed=s)[0]
            assert np.array_equal(outs[0][k], ref), (it, i)
            k += 1
    if rounding == "stochastic":  # same data, fresh seed per bucket and step: different roundings
        assert len({o.tobytes() for o in outs[0]}) == 4


@pytest.mark.parametrize("fmt", ["nvfp4", "e4m3"])
def test_one_rank_quantizes_as_allreduce_does(rng, fmt, monkeypatch):
    """One rank is no special case (the rule of docs/adapters.md, "One process"): with no process
    group, or a transport of one rank, the hook returns what giftcomm.allreduce returns at P = 1,
    the bucket once through the wire format, bit for bit; DDP's warm-up leaves it as it is."""
    import torch.distributed as dist

    assert not dist.is_initialized()
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    x = torch.from_numpy(rng.standard_normal(int(rng.integers(1000, 5000))).astype(np.float32))
    want = simulate_allreduce([x.numpy()], fmt, None, "avg")[0]
    assert not np.array_equal(want, x.numpy())  # the wire format rounds: the test can tell
    st = GiftState(fmt=fmt, schedule=GiftSchedule(geometry="reduced"))
    buf = x.clone()
    out = gift_hook(st, FakeBucket(buf)).wait()
    assert out is buf and np.array_equal(out.numpy(), want) and st.iter == 1 and st.stats().host_buckets == 1
    st1 = GiftState(fmt=fmt, transport=DeviceLoopbackGroup(1).transports[0])
    assert np.array_equal(gift_hook(st1, FakeBucket(x.clone())).wait().numpy(), want)
    warm = GiftState(fmt=fmt, schedule=GiftSchedule(warmup=1))
    assert torch.equal(gift_hook(warm, FakeBucket(x.clone())).wait(), x) and warm.stats().warmup_buckets == 1
    assert np.array_equal(gift_hook(warm, FakeBucket(x.clone())).wait().numpy(), want)
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(RuntimeError, match="init_process_group"):
        gift_hook(st, FakeBucket(x.clone()))
    for s in (st, st1, warm):
        s.shutdown()
