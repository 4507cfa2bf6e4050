"""A CuPy stand-in for the CPU: NumPy-backed "device" arrays, and a ``RawModule`` that compiles the
CUDA source it is given (the exact text giftcomm.cuda._loader hands NVRTC) as host C++ against
tests/emulator/simt.h and runs the kernels there (tests/emulator/build.py).

What it checks that NumPy alone would not:
- every kernel launch: the argument count and each argument's type against the kernel's compiled
  signature (a float32 array for ``const float*``, ``numpy.int32`` for ``int``, ...; a Python
  int or a NumPy array is refused, as it would be misread or refused by CuPy), the block size
  against the kernel's ``__launch_bounds__``, and the launch itself (the shim reports warp
  shuffles outside the member mask, lanes with different masks, deadlocks);
- memory: every allocation sits between guard bytes, checked after each launch (a write past
  either end of any live array raises; with ``asan=True`` allocations are exact-size malloc
  blocks instead, so that AddressSanitizer's redzones catch reads too); fresh ``empty`` memory
  is filled with 0xCD, not zeros;
- mixing: a NumPy array given where a device array is expected raises TypeError (CuPy does too);
- ``ftz=True`` (:func:`make`): float32 elementwise arithmetic and float32<->float64 casts flush
  subnormal inputs and results to zero like CuPy's kernels, which are compiled with -ftz=true;
- ``allocations``: how many device buffers were allocated (the steady-state allocation test).

Only what giftcomm uses is there. ``make(ftz=..., asan=...)`` builds a fresh module object;
install it with ``monkeypatch.setitem(sys.modules, "cupy", module)``.
"""
from __future__ import annotations

import ctypes
import threading
import types
import weakref
from typing import Any

import numpy as np

GUARD = 256  # bytes before and after every allocation (also the alignment of its start)
_FILL_GUARD = 0xA5
_FILL_EMPTY = 0xCD

_PARAM_DTYPES = {"f32": np.float32, "f64": np.float64, "u8": np.uint8, "i8": np.int8, "u16": np.uint16,
                 "i16": np.int16, "u32": np.uint32, "i32": np.int32, "u64": np.uint64, "i64": np.int64}
_CTYPES = {"f32": ctypes.c_float, "f64": ctypes.c_double, "u8": ctypes.c_uint8, "i8": ctypes.c_int8,
           "u16": ctypes.c_uint16, "i16": ctypes.c_int16, "u32": ctypes.c_uint32, "i32": ctypes.c_int32,
           "u64": ctypes.c_uint64, "i64": ctypes.c_int64}


def flush_subnormals32(a: np.ndarray) -> None:
    """In place: float32 subnormals of ``a`` become zeros of the same sign (what -ftz=true does)."""
    bits = a.reshape(-1).view(np.uint32) if a.flags.c_contiguous else None
    if bits is None:
        flat = np.ascontiguousarray(a)
        flush_subnormals32(flat)
        a[...] = flat
        return
    sub = (bits & np.uint32(0x7FFFFFFF)) < np.uint32(0x00800000)
    bits[sub] &= np.uint32(0x80000000)


class _Data:
    __slots__ = ("ptr",)

    def __init__(self, ptr: int) -> None:
        self.ptr = ptr


class _Runtime:
    """State of one stand-in module: allocation ledger, settings."""

    def __init__(self, ftz: bool, asan: bool) -> None:
        self.ftz = ftz
        self.asan = asan
        self.allocations = 0
        self.launches: dict[str, int] = {}
        self.raw: dict[int, tuple] = {}  # id -> (weak reference, body start, body bytes) of each live allocation
        self.lock = threading.Lock()

    def alloc(self, nbytes: int, fill: int | None = _FILL_EMPTY) -> np.ndarray:
        """A uint8 buffer of ``nbytes`` between guards, its start 256-byte aligned."""
        if self.asan:  # an exact-size malloc block: AddressSanitizer's redzones sit right at both ends
            body = np.empty(nbytes, np.uint8)
            if fill is not None:
                body[...] = fill
            with self.lock:
                self.allocations += 1
            return body
        raw = np.empty(nbytes + 3 * GUARD, np.uint8)
        start = (-raw.ctypes.data) % GUARD + GUARD
        raw[:start] = _FILL_GUARD
        raw[start + nbytes :] = _FILL_GUARD
        body = raw[start : start + nbytes]  # NumPy's base of any view is `raw`, the owner
        if fill is not None:
            body[...] = fill
        with self.lock:
            self.allocations += 1
            k = id(raw)
            self.raw[k] = (weakref.ref(raw, lambda _r, k=k: self.raw.pop(k, None)), start, nbytes)
        return body

    def check_guards(self, kernel: str) -> None:
        for ref, start, nbytes in list(self.raw.values()):
            a = ref()
            if a is None:
                continue
            lo, hi = a[:start], a[start + nbytes :]
            if (lo != _FILL_GUARD).any() or (hi != _FILL_GUARD).any():
                side = "before" if (lo != _FILL_GUARD).any() else "after"
                raise RuntimeError(f"{kernel}: out-of-bounds write {side} a {nbytes}-byte device array")


def make(ftz: bool = False, asan: bool = False) -> types.ModuleType:
    """A fresh stand-in ``cupy`` module (``ftz``: flush float32 subnormals like CuPy's kernels;
    ``asan``: kernels built with -fsanitize=address, for a process started with libasan preloaded)."""
    rt = _Runtime(ftz, asan)
    mod = types.ModuleType("cupy", "NumPy-backed CuPy stand-in (tests/emulator/fake_cupy.py)")
    mod.__file__ = __file__

    class ndarray:  # noqa: N801 - CuPy's name
        """A "device" array: a NumPy view into a guarded allocation; no implicit host conversion."""

        __slots__ = ("_a", "__weakref__")

        def __init__(self, a: np.ndarray) -> None:
            self._a = a

        # ---- attributes
        shape = property(lambda self: self._a.shape)
        size = property(lambda self: self._a.size)
        ndim = property(lambda self: self._a.ndim)
        dtype = property(lambda self: self._a.dtype)
        nbytes = property(lambda self: self._a.nbytes)
        itemsize = property(lambda self: self._a.itemsize)
        strides = property(lambda self: self._a.strides)
        flags = property(lambda self: self._a.flags)
        data = property(lambda self: _Data(int(self._a.ctypes.data)))
        T = property(lambda self: ndarray(self._a.T))
        device = property(lambda self: mod.cuda.Device(0))

        @property
        def __cuda_array_interface__(self) -> dict:
            return {"shape": self._a.shape, "typestr": self._a.dtype.str, "data": (int(self._a.ctypes.data), False),
                    "version": 3, "strides": None if self._a.flags.c_contiguous else self._a.strides}

        def __len__(self) -> int:
            return len(self._a)

        def __repr__(self) -> str:
            return f"fake_cupy.ndarray({self._a!r})"

        def __array__(self, *a: Any, **k: Any) -> Any:
            raise TypeError("Implicit conversion to a NumPy array is not allowed: use .get() or cupy.asnumpy()")

        def get(self) -> np.ndarray:
            return self._a.copy()

        def item(self) -> Any:
            return self._a.item()

        def __float__(self) -> float:
            return float(self._a)

        def __int__(self) -> int:
            return int(self._a)

        def __bool__(self) -> bool:
            return bool(self._a)

        def __index__(self) -> int:
            return int(self._a)

        # ---- views and copies
        def __getitem__(self, key: Any) -> "ndarray":
            return ndarray(np.asarray(self._a[_unwrap_key(key)]))

        def __setitem__(self, key: Any, value: Any) -> None:
            self._a[_unwrap_key(key)] = _device_operand(value)

        def view(self, dtype: Any = None) -> "ndarray":
            return ndarray(self._a.view(np.dtype(dtype)))

        def reshape(self, *shape: Any, **kw: Any) -> "ndarray":
            r = self._a.reshape(*shape, **kw)
            if not np.shares_memory(r, self._a) and r.size:
                return _adopt(r)
            return ndarray(r)

        def ravel(self) -> "ndarray":
            return self.reshape(-1)

        def copy(self, order: str = "C") -> "ndarray":
            return _adopt(self._a.copy())

        def astype(self, dtype: Any, copy: bool = True, **kw: Any) -> "ndarray":
            dt = np.dtype(dtype)
            if dt == self._a.dtype and not copy:
                return self
            src = self._a
            if rt.ftz and src.dtype == np.float32 and dt != np.float32:
                src = src.copy()
                flush_subnormals32(src)  # cvt.ftz: a subnormal float32 source reads as zero
            with np.errstate(all="ignore"):
                out = src.astype(dt)
            if rt.ftz and dt == np.float32 and self._a.dtype != np.float32:
                flush_subnormals32(out)  # cvt.rn.ftz.f32.f64: a subnormal result becomes zero
            return _adopt(out)

        def fill(self, value: Any) -> None:
            self._a.fill(value)

        def sum(self, *a: Any, **k: Any) -> "ndarray":
            return _call(np.sum, (self,) + a, k)

        def max(self, *a: Any, **k: Any) -> "ndarray":
            return _call(np.max, (self,) + a, k)

        def min(self, *a: Any, **k: Any) -> "ndarray":
            return _call(np.min, (self,) + a, k)

        def any(self, *a: Any, **k: Any) -> "ndarray":
            return _call(np.any, (self,) + a, k)

        def all(self, *a: Any, **k: Any) -> "ndarray":
            return _call(np.all, (self,) + a, k)

        def __dlpack_device__(self) -> tuple[int, int]:
            return (2, 0)

        # ---- arithmetic: NumPy ufuncs on the backing arrays (flushing float32 subnormals if ftz)
        def __array_ufunc__(self, ufunc: Any, method: str, *inputs: Any, **kw: Any) -> Any:
            out = kw.get("out")
            outs = out if isinstance(out, tuple) else ((out,) if out is not None else ())
            args = [_device_operand(i) for i in inputs]
            if rt.ftz:
                args = [_flushed_copy(a) for a in args]
            if outs:
                kw["out"] = tuple(_device_operand(o) for o in outs)
            with np.errstate(all="ignore"):
                res = getattr(ufunc, method)(*args, **kw)
            results = res if isinstance(res, tuple) else (res,)
            if rt.ftz:
                for r in results:
                    if isinstance(r, np.ndarray) and r.dtype == np.float32:
                        flush_subnormals32(r)
            wrapped = tuple(outs[i] if i < len(outs) else _adopt(np.asarray(r)) for i, r in enumerate(results))
            return wrapped if isinstance(res, tuple) else wrapped[0]

    def _binop(ufunc: Any, reflected: bool = False, inplace: bool = False) -> Any:
        if inplace:
            return lambda self, o: ufunc(self, o, out=(self,))
        if reflected:
            return lambda self, o: ufunc(o, self)
        return lambda self, o: ufunc(self, o)

    for name, uf in (("add", np.add), ("sub", np.subtract), ("mul", np.multiply), ("truediv", np.true_divide),
                     ("floordiv", np.floor_divide), ("mod", np.remainder), ("pow", np.power), ("and", np.bitwise_and),
                     ("or", np.bitwise_or), ("xor", np.bitwise_xor), ("lshift", np.left_shift), ("rshift", np.right_shift)):
        setattr(ndarray, f"__{name}__", _binop(uf))
        setattr(ndarray, f"__r{name}__", _binop(uf, reflected=True))
        setattr(ndarray, f"__i{name}__", _binop(uf, inplace=True))
    for name, uf in (("eq", np.equal), ("ne", np.not_equal), ("lt", np.less), ("le", np.less_equal), ("gt", np.greater),
                     ("ge", np.greater_equal)):
        setattr(ndarray, f"__{name}__", _binop(uf))
    ndarray.__neg__ = lambda self: np.negative(self)  # type: ignore[attr-defined]
    ndarray.__abs__ = lambda self: np.absolute(self)  # type: ignore[attr-defined]
    ndarray.__invert__ = lambda self: np.invert(self)  # type: ignore[attr-defined]
    ndarray.__hash__ = None  # type: ignore[assignment]

    def _unwrap_key(key: Any) -> Any:
        if isinstance(key, ndarray):
            return key._a
        if isinstance(key, tuple):
            return tuple(_unwrap_key(k) for k in key)
        return key

    def _device_operand(v: Any) -> Any:
        if isinstance(v, ndarray):
            return v._a
        if isinstance(v, np.ndarray) and v.ndim > 0:
            raise TypeError(f"a host NumPy array (shape {v.shape}) was given where a device array is expected")
        return v

    def _flushed_copy(a: Any) -> Any:
        if isinstance(a, np.ndarray) and a.dtype == np.float32:
            a = a.copy()
            flush_subnormals32(a)
        elif isinstance(a, np.float32):
            b = np.array(a)
            flush_subnormals32(b)
            a = b[()]
        return a

    def _adopt(a: np.ndarray) -> ndarray:
        """A new device array holding a copy of host array ``a`` (one allocation)."""
        a = np.asarray(a)
        body = rt.alloc(a.nbytes, fill=None)
        dev = body.view(a.dtype).reshape(a.shape) if a.dtype.itemsize else body
        dev[...] = a
        return ndarray(dev)

    def _wrap_result(r: Any, inputs: tuple) -> Any:
        if isinstance(r, np.ndarray):
            for i in inputs:
                if isinstance(i, ndarray) and r is i._a:
                    return i
            return _adopt(r)
        if isinstance(r, (tuple, list)):
            return type(r)(_wrap_result(x, inputs) for x in r)
        if isinstance(r, np.generic):
            return _adopt(np.asarray(r))
        return r

    def _unwrap_all(v: Any) -> Any:
        if isinstance(v, (list, tuple)):
            return type(v)(_unwrap_all(x) for x in v)
        return _device_operand(v)

    def _call(fn: Any, args: tuple, kw: dict) -> Any:
        with np.errstate(all="ignore"):
            r = fn(*_unwrap_all(args), **{k: _unwrap_all(v) for k, v in kw.items()})
        return _wrap_result(r, args + tuple(kw.values()))

    # ---- module functions
    def empty(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
        dt = np.dtype(dtype)
        n = int(np.prod(shape)) if not isinstance(shape, (int, np.integer)) else int(shape)
        body = rt.alloc(n * dt.itemsize)
        return ndarray(body.view(dt).reshape(shape))

    def zeros(shape: Any, dtype: Any = float, order: str = "C") -> ndarray:
        a = empty(shape, dtype)
        a._a[...] = 0
        return a

    def ones(shape: Any, dtype: Any = float) -> ndarray:
        a = empty(shape, dtype)
        a._a[...] = 1
        return a

    def full(shape: Any, fill_value: Any, dtype: Any = None) -> ndarray:
        a = empty(shape, dtype if dtype is not None else np.asarray(fill_value).dtype)
        a._a[...] = fill_value
        return a

    def empty_like(a: Any, dtype: Any = None) -> ndarray:
        return empty(a.shape, dtype or a.dtype)

    def zeros_like(a: Any, dtype: Any = None) -> ndarray:
        return zeros(a.shape, dtype or a.dtype)

    def array(obj: Any, dtype: Any = None, copy: bool = True, order: str = "K") -> ndarray:
        if isinstance(obj, ndarray):
            if dtype is not None and np.dtype(dtype) != obj.dtype:
                return obj.astype(dtype)
            return obj.copy() if copy else obj
        return _adopt(np.array(obj, dtype=dtype))  # host -> device copy

    def asarray(obj: Any, dtype: Any = None, order: str | None = None) -> ndarray:
        if isinstance(obj, ndarray):
            return obj if dtype is None or np.dtype(dtype) == obj.dtype else obj.astype(dtype)
        if hasattr(obj, "__cuda_array_interface__") and not isinstance(obj, np.ndarray):
            raise TypeError("fake_cupy: foreign __cuda_array_interface__ objects are not supported")
        return _adopt(np.asarray(obj, dtype=dtype))

    def ascontiguousarray(obj: Any, dtype: Any = None) -> ndarray:
        a = asarray(obj, dtype)
        return a if a.flags.c_contiguous else a.copy()

    def asnumpy(a: Any, stream: Any = None, out: Any = None) -> np.ndarray:
        return a.get() if isinstance(a, ndarray) else np.asarray(a)

    def get_array_module(*args: Any) -> Any:
        return mod if any(isinstance(a, ndarray) for a in args) else np

    def from_dlpack(obj: Any) -> ndarray:
        """A device array over a DLPack producer's memory. The stand-in takes CPU producers too (the
        tests make them look like CUDA ones) and, like CuPy 13, refuses bfloat16."""
        if isinstance(obj, ndarray):
            return obj
        if "bfloat16" in str(getattr(obj, "dtype", "")):
            raise TypeError("fake_cupy.from_dlpack: bfloat16 is not supported (as in CuPy 13)")
        return ndarray(np.from_dlpack(obj))

    # ---- kernels
    class RawKernel:
        def __init__(self, lib: Any, name: str, signature: str, max_threads: int) -> None:
            self.lib, self.name, self.max_threads = lib, name, max_threads
            self.params = signature.split(",") if signature else []

        def _marshal(self, i: int, code: str, a: Any) -> Any:
            where = f"{self.name}: argument {i}"
            if code.endswith("*"):
                kind = code.lstrip("c")[:-1]
                if isinstance(a, np.uint64) and int(a) == 0:
                    return ctypes.c_uint64(0)
                if not isinstance(a, ndarray):
                    raise TypeError(f"{where}: {code} needs a device array (or numpy.uint64(0) for NULL), got {type(a).__name__}")
                if kind != "v" and a.dtype != np.dtype(_PARAM_DTYPES[kind]):
                    raise TypeError(f"{where}: {code} needs a {np.dtype(_PARAM_DTYPES[kind])} array, got {a.dtype}")
                if not a.flags.c_contiguous:
                    raise TypeError(f"{where}: not contiguous")
                return ctypes.c_uint64(a.data.ptr)
            want = _PARAM_DTYPES[code]
            if type(a) is not want:
                raise TypeError(f"{where}: {code} needs numpy.{np.dtype(want).name}, got {type(a).__name__} {a!r}")
            return _CTYPES[code](a.item())

        def __call__(self, grid: Any, block: Any, args: tuple, shared_mem: int = 0, stream: Any = None) -> None:
            g = tuple(grid) if isinstance(grid, tuple) else (int(grid),)
            b = tuple(block) if isinstance(block, tuple) else (int(block),)
            g, b = (g + (1, 1))[:3], (b + (1, 1))[:3]
            if any(not isinstance(v, (int, np.integer)) or v < 1 for v in g + b):
                raise ValueError(f"{self.name}: bad launch shape grid={grid} block={block}")
            if g[0] >= 2**31 or g[1] > 65535 or g[2] > 65535:
                raise ValueError(f"{self.name}: grid {g} beyond the device limits")
            threads = b[0] * b[1] * b[2]
            if threads > self.max_threads:
                raise ValueError(f"{self.name}: {threads} threads per block > __launch_bounds__ {self.max_threads}")
            if len(args) != len(self.params):
                raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters ({','.join(self.params)})")
            vals = [self._marshal(i, c, a) for i, (c, a) in enumerate(zip(self.params, args))]
            ptrs = (ctypes.c_void_p * max(1, len(vals)))(*[ctypes.addressof(v) for v in vals])
            gg, bb = (ctypes.c_uint * 3)(*g), (ctypes.c_uint * 3)(*b)
            with _LAUNCH_LOCK:
                rc = self.lib.gcemu_launch(self.name.encode(), gg, bb, ptrs)
                msg = self.lib.gcemu_error().decode() if rc else ""
                rt.launches[self.name] = rt.launches.get(self.name, 0) + 1
            if rc:
                raise RuntimeError(f"{self.name} grid={g} block={b}: {msg}")
            rt.check_guards(self.name)

    class RawModule:
        def __init__(self, code: str | None = None, options: tuple = (), backend: str = "nvrtc", **kw: Any) -> None:
            from . import build

            if code is None:
                raise TypeError("fake_cupy.RawModule needs code=")
            self.code, self.options, self.backend = code, tuple(options), backend
            self._info = build.build(code, asan=rt.asan)
            self.kernels = dict(self._info.kernels)

        def compile(self, *a: Any, **k: Any) -> None:
            pass

        def get_function(self, name: str) -> RawKernel:
            if name not in self.kernels:
                raise RuntimeError(f"CUDA_ERROR_NOT_FOUND: named symbol not found: {name}")
            sig, bound = self.kernels[name]
            return RawKernel(self._info.lib, name, sig, bound)

    # ---- cuda namespace
    class _Stream:
        ptr = 0

        def synchronize(self) -> None:
            pass

        def __enter__(self) -> "_Stream":
            return self

        def __exit__(self, *a: Any) -> None:
            pass

    class Device:
        def __init__(self, device: int | None = None) -> None:
            self.id = 0 if device is None else int(device)
            if self.id != 0:
                raise RuntimeError("fake_cupy: one device only")

        def __enter__(self) -> "Device":
            return self

        def __exit__(self, *a: Any) -> None:
            pass

        def use(self) -> None:
            pass

        def synchronize(self) -> None:
            pass

    _stream = _Stream()
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 1, deviceSynchronize=lambda: None)
    cuda = types.SimpleNamespace(Device=Device, runtime=runtime, get_current_stream=lambda: _stream,
                                 Stream=lambda **k: _Stream(), ExternalStream=lambda ptr: _Stream())

    for k, v in dict(ndarray=ndarray, empty=empty, zeros=zeros, ones=ones, full=full, empty_like=empty_like,
                     zeros_like=zeros_like, array=array, asarray=asarray, ascontiguousarray=ascontiguousarray,
                     asnumpy=asnumpy, get_array_module=get_array_module, from_dlpack=from_dlpack,
                     RawKernel=RawKernel, RawModule=RawModule, cuda=cuda, runtime_state=rt,
                     nan=np.nan, inf=np.inf, newaxis=None).items():
        setattr(mod, k, v)
    for name in ("float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32",
                 "uint64", "bool_", "dtype", "intp"):
        setattr(mod, name, getattr(np, name))

    def __getattr__(name: str) -> Any:  # everything else: the NumPy function over device operands
        obj = getattr(np, name)
        if isinstance(obj, np.ufunc) or isinstance(obj, type):
            return obj
        if callable(obj):
            return lambda *a, **k: _call(obj, a, k)
        return obj

    mod.__getattr__ = __getattr__  # type: ignore[attr-defined]
    return mod


_LAUNCH_LOCK = threading.Lock()  # one launch at a time (the shim's scheduler is process-global)
