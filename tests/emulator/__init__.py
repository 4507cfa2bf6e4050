"""The CUDA kernels on the CPU: a SIMT shim (simt.h), its build (build.py) and a CuPy stand-in
(fake_cupy.py) through which giftcomm.cuda.codec launches the real kernel bodies. docs/gpu.md."""
