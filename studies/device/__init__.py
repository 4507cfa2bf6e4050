"""The GPU device check behind perf/device_check.sh (``python -m studies device-check``):
kernels and collectives on CuPy against giftcomm.reference, bit for bit (``check``); the device
collectives on any array backend (``collective_check``); named edge values (``edge_cases``)."""
