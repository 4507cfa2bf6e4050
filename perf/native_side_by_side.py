"""e4m3 native kernels (encode, decode, fused hop) in M values/s, called directly: PYTHONPATH=<tree> python perf/native_side_by_side.py old|new (the label also picks the old or new argument list)."""
import sys, timeit, numpy as np
from giftcomm import _codec_native as nat
from giftcomm.formats import get_format, message_nbytes
f = get_format("e4m3")
for n in (1 << 16, 1 << 22):
    x = np.random.default_rng(0).standard_normal(n).astype(np.float32)
    msg = np.empty(message_nbytes(n, f, 256), np.uint8)
    out = np.empty(n, np.float32)
    new = sys.argv[1] == "new"
    enc = (lambda: nat.encode(x, msg, f.code, 256, None, 0)) if new else (lambda: nat.encode(x, msg, f.code, 256))
    enc()
    dec = lambda: nat.decode(msg, out, f.code, 256)
    dae = (lambda: nat.decode_add_encode(msg, x, msg2, None, f.code, 256, None, 0)) if new else (lambda: nat.decode_add_encode(msg, x, msg2, None, f.code, 256))
    msg2 = np.empty_like(msg)
    for name, fn in (("encode", enc), ("decode", dec), ("dae", dae)):
        t = min(timeit.repeat(fn, number=50, repeat=7)) / 50
        print(sys.argv[1], n, name, f"{n / t / 1e6:8.0f} M/s", nat._isa())
