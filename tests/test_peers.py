"""The peers' reduction semantics (studies.peers): each emulation within its format's error bound
of the exact sum, sending the bytes it claims, degenerating correctly (P = 1, zeros, NaN), and
the ``python -m studies peers`` command end to end on a small capture-format file."""
from __future__ import annotations

import dataclasses
import json

import ml_dtypes
import numpy as np
import pytest

from giftcomm.formats import FORMATS, get_format
from giftcomm.reference.baselines import simulate_baseline_allreduce
from studies import peers as pr

PEER_NAMES = list(pr.PEERS)
E4M3_U, E5M2_U = 2.0**-4, 2.0**-3  # unit roundoff (half an ulp, relative) of the FP8 elements
E4M3_SUB, E5M2_SUB = 2.0**-10, 2.0**-17  # half the smallest subnormal step, in units of the scale
BF16_ULP, FP16_U = 2.0**-7, 2.0**-11


def _inputs(rng, p: int, n: int, scale: float = 1.0) -> list[np.ndarray]:
    """P ranks' gradients: a shared signal, per-rank noise, a few coordinates much larger."""
    common = rng.standard_normal(n)
    xs = []
    for _ in range(p):
        x = common + rng.standard_normal(n)
        x[rng.integers(0, n, 3)] *= 8
        xs.append((scale * x).astype(np.float32))
    return xs


def _block_amax(x: np.ndarray, block: int) -> np.ndarray:
    """Per value: the amax of its block (blocks of ``block`` counted from x[0])."""
    nb = -(-x.size // block)
    pad = np.zeros(nb * block)
    pad[: x.size] = np.abs(x)
    return np.repeat(pad.reshape(nb, block).max(axis=1), block)[: x.size]


def _bound(name: str, xs: list[np.ndarray]) -> np.ndarray:
    """Elementwise bound on |emulated sum - exact sum| from the semantics' definition."""
    p = len(xs)
    mag = np.sum([np.abs(x.astype(np.float64)) for x in xs], axis=0)  # >= every |partial sum|
    if name.startswith("nccl-fp8-raw/"):
        u, a = (E4M3_U, E4M3_SUB) if name.endswith("e4m3") else (E5M2_U, E5M2_SUB)
        # P encodes and P-1 fp16 additions each rounded back to FP8: at most 2P roundings
        return 2 * p * ((u + FP16_U) * mag + a)
    if name == "gift-artifact/e5m2-tensor-nccl":
        s = max(float(np.abs(x).max()) for x in xs) / 57344
        return 2 * p * ((E5M2_U + FP16_U) * mag + E5M2_SUB * s)
    if name == "dynamiq/mxfp8-shared":
        s = p * np.max([_block_amax(x, 32) for x in xs], axis=0) / 448 * 2  # the scale, within 2x
        return p * (E4M3_U * mag + E4M3_SUB * s) * 1.01
    if name == "flashinfer/two-shot-fp8":
        amax = np.sum([_block_amax(x, 256) for x in xs], axis=0)
        per = (2.0**-8 + E4M3_U) * mag * (1 + 2.0**-7) + E4M3_SUB * amax / 448
        return 2 * per + 2.0**-8 * mag * 1.2  # inputs, then the re-quantized stripe, then the BF16 output
    if name.startswith("zeropp/qgz"):
        amax = np.sum([_block_amax(x, 512) for x in xs], axis=0) * (1 + 2.0**-10)
        hops = 1 + (p > 8) + name.endswith("int4")  # INT4 round trips of (at most) the whole sum
        # an INT4 step is at most half a level (amax/14); fp16 casts and additions ~2^-11 each
        return (1 + hops) * amax / 14 + 3 * p * FP16_U * mag
    if name.startswith("torchcomms/"):
        return (p + 1) * BF16_ULP * mag * (1 + 2.0**-6)  # a stochastic rounding is off by < 1 ulp
    raise AssertionError(f"no bound for {name}")


@pytest.mark.parametrize("name", [n for n in PEER_NAMES if n != "gift-artifact/e5m2-tensor-local"])
@pytest.mark.parametrize("p", [1, 2, 3, 5, 8, 16])
def test_every_peer_is_the_exact_sum_within_its_error_bound(name, p, rng):
    n = int(rng.integers(600, 3000))
    xs = _inputs(rng, p, n)
    keep = [x.copy() for x in xs]
    red = pr.PEERS[name].simulate(xs, [(0, n // 3), (n // 3, n)], int(rng.integers(1 << 30)))
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    err = np.abs(red.total.astype(np.float64) - exact)
    bound = _bound(name, xs)
    worst = int(np.argmax(err - bound))
    assert np.all(err <= bound), f"{name}, P={p}: |error| {err[worst]:.3g} > bound {bound[worst]:.3g} at {worst}"
    # a real quantization happened: not the float32 sum in disguise
    assert pr.fidelity(red.total, exact, p)["rel_l2"] > 1e-4
    assert all(np.array_equal(x, k) for x, k in zip(xs, keep)), "the caller's inputs were modified"


def _one_rank_bound(name: str, x: np.ndarray, p: int) -> np.ndarray:
    """Bound on |result - x| when only one of P ranks sends x (the others zeros): adding a zero
    is exact in every semantics, so only the roundings of x itself remain, whatever P."""
    m = np.abs(x.astype(np.float64))
    if name.startswith("nccl-fp8-raw/"):
        u, a = (E4M3_U, E4M3_SUB) if name.endswith("e4m3") else (E5M2_U, E5M2_SUB)
        return u * m + a
    if name == "gift-artifact/e5m2-tensor-nccl":
        return E5M2_U * m + E5M2_SUB * float(m.max()) / 57344
    if name == "dynamiq/mxfp8-shared":
        return E4M3_U * m + E4M3_SUB * 2 * p * _block_amax(x, 32) / 448
    if name == "flashinfer/two-shot-fp8":
        return (2 * E4M3_U + 2 * 2.0**-8) * m * 1.1 + 2 * E4M3_SUB * _block_amax(x, 256) / 448
    if name.startswith("zeropp/qgz"):
        hops = 1 + (p > 8) + name.endswith("int4")
        return hops * _block_amax(x, 512) * (1 + 2.0**-10) / 14 + 4 * FP16_U * m
    if name.startswith("torchcomms/"):
        return 2 * BF16_ULP * m
    raise AssertionError(f"no bound for {name}")


@pytest.mark.parametrize("name", [n for n in PEER_NAMES if n != "gift-artifact/e5m2-tensor-local"])
@pytest.mark.parametrize("p", [3, 16])
def test_every_rank_is_summed_once(name, p, rng):
    """One rank at a time sends data, the others zeros: the result is that rank's vector to
    within its own roundings (a rank dropped or counted twice is off by all of it)."""
    n = int(rng.integers(1500, 3000))
    x = _inputs(rng, 1, n)[0]
    for r in sorted({0, p - 1, int(rng.integers(p))}):
        xs = [x if q == r else np.zeros(n, np.float32) for q in range(p)]
        err = np.abs(pr.PEERS[name].simulate(xs, [(0, n)], 3).total - x.astype(np.float64))
        assert np.all(err <= _one_rank_bound(name, x, p)), f"{name}, P={p}, rank {r}: max error {err.max():.3g}"


@pytest.mark.parametrize("p", [2, 5, 16])
def test_qgz_error_is_int4_rounding_noise(p, rng):
    """INT4 rounding errors are uniform within half a level: each round trip adds (amax/7)^2 / 12
    of variance per value (blocks of 512). The measured mean square error must match that model
    (a worst-case bound would let a dropped rank through)."""
    n = 512 * 16 * 4
    xs = _inputs(rng, p, n)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    var = np.sum([(_block_amax(x, 512) / 7) ** 2 / 12 for x in xs], axis=0)  # the reduce-scatter hop
    if p > 8:  # the node sums, re-quantized for the inter-node hop
        nodes = [np.sum([x.astype(np.float64) for x in xs[j:j + 8]], axis=0) for j in range(0, p, 8)]
        var = var + np.sum([(_block_amax(s, 512) / 7) ** 2 / 12 for s in nodes], axis=0)
    fp16 = pr.PEERS["zeropp/qgz-fp16"].simulate(xs, (), 0).total
    int4 = pr.PEERS["zeropp/qgz-int4"].simulate(xs, (), 0).total
    assert 0.6 < np.mean((fp16 - exact) ** 2) / np.mean(var) < 1.4
    with_ag = var + (_block_amax(exact, 512) / 7) ** 2 / 12  # the INT4 allgather: one more round trip
    assert 0.6 < np.mean((int4 - exact) ** 2) / np.mean(with_ag) < 1.4


def _aligned_n(rng) -> int:
    return 2048 * 16 * int(rng.integers(1, 3))  # whole blocks and nvfp4 groups in every chunk, P <= 16


@pytest.mark.parametrize("p", [2, 4, 16])
def test_every_semantics_sends_the_bytes_it_claims(p, rng):
    n = _aligned_n(rng)
    xs = _inputs(rng, p, n)
    tensors = [(0, 1000), (1000, 5000), (5000, n)]
    for s in pr.giftcomm_semantics() + list(pr.PEERS.values()):
        red = s.simulate(xs, tensors, 7)
        counted = pr.bits_per_value(red.wire_bytes, n, p)
        assert counted == pytest.approx(s.claimed_bits(n, p, tensors), rel=1e-12), s.name


def test_the_claimed_bits_are_the_formats_own():
    by = {s.name: s.claimed_bits(1 << 20, 8, ()) for s in list(pr.PEERS.values())}
    assert by["nccl-fp8-raw/e4m3"] == by["nccl-fp8-raw/e5m2"] == 8
    assert by["dynamiq/mxfp8-shared"] == 8.25  # 8-bit codes + one E8M0 byte per 32 values
    assert by["flashinfer/two-shot-fp8"] == 8.125  # 8-bit codes + a float32 per 256 values
    assert by["zeropp/qgz-int4"] == 4.0625 and by["zeropp/qgz-fp16"] == (4.0625 + 16) / 2
    assert by["torchcomms/bf16-sr-ring"] == by["torchcomms/bf16-sr-direct"] == 16


@pytest.mark.parametrize("name", PEER_NAMES)
def test_unaligned_sizes_send_at_least_the_claim_and_not_much_more(name, rng):
    p, n = 5, int(rng.integers(20_000, 40_000))
    xs = _inputs(rng, p, n)
    s = pr.PEERS[name]
    counted = pr.bits_per_value(s.simulate(xs, (), 3).wire_bytes, n, p)
    claim = s.claimed_bits(n, p, ())
    assert claim * (1 - 1e-12) <= counted <= claim * 1.02


@pytest.mark.parametrize("name", PEER_NAMES)
def test_one_rank_sends_nothing_and_keeps_one_rounding(name, rng):
    n = int(rng.integers(100, 2000))
    x = _inputs(rng, 1, n)[0]
    red = pr.PEERS[name].simulate([x], (), 1)
    assert red.wire_bytes == 0
    assert np.isnan(pr.bits_per_value(red.wire_bytes, n, 1))
    if name != "gift-artifact/e5m2-tensor-local":  # one rank: its own scale is the agreed one
        assert np.all(np.abs(red.total - x) <= _bound(name, [x]))
    else:
        ref = pr.PEERS["gift-artifact/e5m2-tensor-nccl"].simulate([x], (), 1).total
        np.testing.assert_array_equal(red.total, ref)


@pytest.mark.parametrize("p", [1, 3, 16])
def test_zeros_reduce_to_exact_zeros_for_every_semantics(p, rng):
    n = int(rng.integers(10, 3000))
    xs = [np.zeros(n, np.float32) for _ in range(p)]
    for s in pr.giftcomm_semantics(roundings=("nearest", "stochastic")) + list(pr.PEERS.values()):
        red = s.simulate(xs, [(0, n)], 5)
        assert red.total.shape == (n,) and not np.any(red.total), s.name
        m = pr.fidelity(red.total, np.zeros(n), p)
        assert m["rel_l2"] == 0 and m["adam_median"] == 0 and m["cosine"] == 1.0


@pytest.mark.parametrize("name", PEER_NAMES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_inputs_are_refused(name, bad, rng):
    xs = _inputs(rng, 3, 500)
    xs[int(rng.integers(3))][int(rng.integers(500))] = bad
    keep = [x.copy() for x in xs]
    with pytest.raises(ValueError, match="non-finite"):
        pr.PEERS[name].simulate(xs, (), 0)
    assert all(np.array_equal(x, k, equal_nan=True) for x, k in zip(xs, keep))


@pytest.mark.parametrize("name", PEER_NAMES)
def test_bad_shapes_are_refused(name, rng):
    with pytest.raises(ValueError, match="at least one"):
        pr.PEERS[name].simulate([], (), 0)
    with pytest.raises(ValueError, match="same number"):
        pr.PEERS[name].simulate([np.zeros(4, np.float32), np.zeros(5, np.float32)], (), 0)


@pytest.mark.parametrize("p", [2, 3, 7])
def test_raw_e4m3_is_the_tensor_nccl_baseline_when_the_agreed_scale_is_one(p, rng):
    """Two independent implementations of NCCL's FP8 ring sum: with max |x| over the ranks exactly
    448 the per-tensor baseline's scale is 1, so it must equal the raw FP8 sum bit for bit."""
    n = int(rng.integers(50, 2000))
    xs = [np.clip(x, -440, 440) for x in _inputs(rng, p, n, scale=20.0)]
    xs[int(rng.integers(p))][int(rng.integers(n))] = -448.0
    raw = pr.PEERS["nccl-fp8-raw/e4m3"].simulate(xs, (), 0).total
    base = simulate_baseline_allreduce(xs, "e4m3/tensor-nccl", "sum")[0]
    np.testing.assert_array_equal(raw, base)


def test_raw_fp8_flushes_what_its_range_cannot_hold(rng):
    """No scale: gradients far below E4M3's smallest subnormal (2^-9) vanish, E5M2 keeps them."""
    xs = _inputs(rng, 4, 1000, scale=1e-4)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    e4 = pr.PEERS["nccl-fp8-raw/e4m3"].simulate(xs, (), 0).total
    e5 = pr.PEERS["nccl-fp8-raw/e5m2"].simulate(xs, (), 0).total
    assert np.count_nonzero(e4) < 0.05 * e4.size
    assert pr.fidelity(e5, exact, 4)["rel_l2"] < 0.5


def test_the_local_scale_artifact_is_biased_when_the_scales_differ(rng):
    p, n = 4, 2000
    xs = _inputs(rng, p, n)
    equal = [x / np.abs(x).max() for x in xs]  # every rank's scale the same: local == agreed
    np.testing.assert_array_equal(pr.PEERS["gift-artifact/e5m2-tensor-local"].simulate(equal, (), 0).total,
                                  pr.PEERS["gift-artifact/e5m2-tensor-nccl"].simulate(equal, (), 0).total)
    xs[0] *= 16  # rank 0's scale 16x the others': it decodes their codes 16x too large
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    local = pr.PEERS["gift-artifact/e5m2-tensor-local"].simulate(xs, (), 0).total
    agreed = pr.PEERS["gift-artifact/e5m2-tensor-nccl"].simulate(xs, (), 0).total
    assert pr.fidelity(local, exact, p)["rel_l2"] > 4 * pr.fidelity(agreed, exact, p)["rel_l2"]


@pytest.mark.parametrize("p", [5, 8, 13])
def test_dynamiq_headroom_holds_p_full_range_values_without_saturating(p, rng):
    """Every rank sends the same values: the sum is P times them. A block scale without the 1/P
    headroom would clip every partial sum below twice the block's amax; with it the largest
    value's sum stays within FP8 addition's swamping (each hop adds at most a 1/16 error)."""
    x = _inputs(rng, 1, 640)[0]
    red = pr.PEERS["dynamiq/mxfp8-shared"].simulate([x] * p, (), 0)
    exact = p * x.astype(np.float64)
    assert np.all(np.abs(red.total - exact) <= _bound("dynamiq/mxfp8-shared", [x] * p))
    top = int(np.argmax(np.abs(x)))
    assert abs(red.total[top]) >= 0.5 * p * abs(x[top]) > 2 * abs(x[top])


def test_torchcomms_rounding_is_unbiased(rng):
    """Stochastic rounding: the mean over many seeds converges on the exact sum (the error of
    the mean of K independent runs shrinks like 1/sqrt(K)); round to nearest would not."""
    p, n, k = 4, 4000, 32
    xs = _inputs(rng, p, n)
    exact = np.sum([x.astype(np.float64) for x in xs], axis=0)
    for name in ("torchcomms/bf16-sr-ring", "torchcomms/bf16-sr-direct"):
        runs = [pr.PEERS[name].simulate(xs, (), s).total.astype(np.float64) for s in range(k)]
        one = np.sqrt(np.mean([(r - exact) ** 2 for r in runs]))
        mean = np.sqrt(np.mean((np.mean(runs, axis=0) - exact) ** 2))
        assert mean < 0.35 * one, name
        assert not np.array_equal(runs[0], runs[1])  # the seed draws the bits
        np.testing.assert_array_equal(runs[0], pr.PEERS[name].simulate(xs, (), 0).total)  # and only the seed


def test_bf16_stochastic_rounding_lands_on_a_neighbour(rng):
    x = (rng.standard_normal(20_000) * np.exp(rng.uniform(-30, 30, 20_000))).astype(np.float32)
    x[:3] = [ml_dtypes.finfo(ml_dtypes.bfloat16).max, 0.0, -1.5]  # already BF16 values stay
    y = pr._bf16_stochastic(x, rng)
    down = np.where(x >= 0, 1, -1) * np.abs(x).view(np.uint32).__and__(0xFFFF0000).view(np.float32)
    up = np.nextafter(down.astype(ml_dtypes.bfloat16), np.copysign(np.inf, x).astype(ml_dtypes.bfloat16))
    assert np.all((y == down) | (y == up.astype(np.float32)))
    np.testing.assert_array_equal(y[:3], x[:3])
    big = np.full(1000, np.float32(3.3e38))  # above the BF16 max: saturates, never Inf
    assert np.all(np.isfinite(pr._bf16_stochastic(big, rng)))


def test_fidelity_metrics_on_a_known_error(rng):
    s = rng.standard_normal(5000) + 3.0
    d = 1e-3
    m = pr.fidelity(s * (1 + d), s, 4)
    assert m["rel_l2"] == pytest.approx(d, rel=1e-9) and m["vnmse"] == pytest.approx(d * d, rel=1e-9)
    assert m["cosine"] == pytest.approx(1.0) and m["adam_median"] == pytest.approx(d, rel=1e-4)
    flipped = pr.fidelity(-s, s, 2)
    assert flipped["cosine"] == pytest.approx(-1.0) and flipped["adam_median"] == pytest.approx(2.0, rel=1e-4)
    assert np.isinf(pr.fidelity(np.full(3, np.inf), np.ones(3), 2)["rel_l2"])


def test_every_format_row_is_a_giftcomm_semantics(monkeypatch):
    names = {s.name for s in pr.giftcomm_semantics(("ring", "direct"), ("nearest", "stochastic"))}
    for f in FORMATS.values():
        for alg in ("ring", "direct"):
            assert f"giftcomm/{f.name}/{alg}" in names
            assert (f"giftcomm/{f.name}-sr/{alg}" in names) == f.scaled
    # a row added to the table later appears without an edit here
    extra = dict(FORMATS, later=dataclasses.replace(get_format("e4m3"), name="later"))
    monkeypatch.setattr(pr, "FORMATS", extra)
    assert "giftcomm/later/ring" in {s.name for s in pr.giftcomm_semantics()}


def test_giftcomm_rows_are_the_reference_simulation(rng):
    from giftcomm.reference import simulate_allreduce

    xs = _inputs(rng, 3, 700)
    for s in pr.giftcomm_semantics(("direct",), ("stochastic",)):
        fmt = s.name.split("/")[1].removesuffix("-sr")
        want = simulate_allreduce(xs, fmt, None, "sum", "direct", rounding="stochastic", seed=11)[0]
        np.testing.assert_array_equal(s.simulate(xs, (), 11).total, want)


# ------------------------------------------------------------------ the command end to end
def _capture(path, rng, ranks=4, steps=2):
    """A small file in the layout of ``python -m studies.gradients`` with Llama-style names."""
    layout = [("embed.weight", [16, 8]), ("blocks.1.attn.q.weight", [8, 8]), ("blocks.3.attn_norm.weight", [8]),
              ("blocks.3.attn.q.weight", [8, 8]), ("blocks.3.mlp.down.weight", [8, 24])]
    n = sum(int(np.prod(s)) for _, s in layout)
    grads = np.stack([np.stack(_inputs(rng, ranks, n, 1e-3)) for _ in range(steps)]).astype(np.float32)
    info = {"config": "test", "parameters": n, "train_steps": 0, "batch": ranks}
    np.savez(path, names=np.array([k for k, _ in layout]), shapes=json.dumps([s for _, s in layout]),
             info=json.dumps(info), grads=grads)
    return path, n - 64


def test_the_command_runs_end_to_end(tmp_path, rng, capsys):
    data, n = _capture(tmp_path / "grads.npz", rng)
    out, js, png = tmp_path / "r.md", tmp_path / "r.json", tmp_path / "r.png"
    rc = pr.main(["--data", str(data), "--P", "2,4", "--json", str(js), "--png", str(png), "--out", str(out),
                  "--no-progress"])
    assert rc == 0
    doc = json.loads(js.read_text())
    names = [s.name for s in pr.giftcomm_semantics()] + PEER_NAMES
    assert doc["values"] == n and doc["tensors"] == 4  # the default segments: embed and block 3
    assert sorted((r["name"], r["P"]) for r in doc["rows"]) == sorted((k, p) for k in names for p in (2, 4))
    for r in doc["rows"]:
        assert r["bits"] >= r["claimed_bits"] * (1 - 1e-12) and np.isfinite(r["rel_l2"]), r["name"]
        assert r["rel_l2"] < (1 if r["family"] == "giftcomm" else 5), r["name"]  # raw FP8 may flush all
    text = out.read_text()
    assert all(k in text for k in names) and "P=4" in text
    assert png.stat().st_size > 10_000
    with pytest.raises(SystemExit, match="needs 8 ranks"):
        pr.main(["--data", str(data), "--P", "8", "--no-progress"])
    with pytest.raises(SystemExit, match="unknown semantics"):
        pr.main(["--data", str(data), "--P", "2", "--only", "nope", "--no-progress"])


def test_the_studies_entry_point_knows_the_command(capsys):
    from studies.__main__ import main

    with pytest.raises(SystemExit) as e:
        main(["peers", "--help"])
    assert e.value.code == 0 and "--data" in capsys.readouterr().out
