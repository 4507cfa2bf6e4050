"""Plain NumPy ground truth: the codec and single-process simulations of every collective."""
from .codec import decode, decode_add_encode, encode
from .simulate import simulate_allgather, simulate_allreduce, simulate_gift_allreduce, simulate_reduce_scatter

__all__ = ["encode", "decode", "decode_add_encode", "simulate_allreduce", "simulate_gift_allreduce", "simulate_reduce_scatter",
           "simulate_allgather"]
