"""giftcomm.perf codec (the codec throughput table of docs/performance.md), on tiny sizes."""
from __future__ import annotations

import numpy as np
import pytest

from giftcomm.perf import codec_bench


@pytest.mark.parametrize("data", ["wide", "normal"])
def test_table_has_every_op_and_names_its_input(capsys, data):
    rc = codec_bench.main(["--sizes", "1K", "--fmt", "e4m3,bf16", "--repeats", "1", "--min-time", "0",
                           "--no-pin", "--data", data])
    out = capsys.readouterr().out
    assert rc == 0 and f"data {data};" in out
    rows = [ln for ln in out.splitlines() if ln.startswith("| e4m3 |") or ln.startswith("| bf16 |")]
    assert len(rows) == 2 * len(codec_bench.OPS)
    for ln in rows:
        cells = [c.strip() for c in ln.strip("|").split("|")]
        assert cells[2] in codec_bench.OPS and float(cells[3].replace(",", "")) > 0  # native M/s


def test_the_two_inputs_differ_where_it_matters(rng):
    """"wide" puts most 256-value blocks' smallest value 2^6 below their amax (FP8-subnormal
    codes); "normal" almost never does."""
    def share_with_subnormal_codes(x):
        blocks = np.abs(x.reshape(-1, 256))
        return np.mean(blocks.min(axis=1) * 448 / blocks.max(axis=1) < 2.0**-6)

    assert share_with_subnormal_codes(codec_bench.DATA["wide"](rng, 1 << 16)) > 0.9
    assert share_with_subnormal_codes(codec_bench.DATA["normal"](rng, 1 << 16)) < 0.1
