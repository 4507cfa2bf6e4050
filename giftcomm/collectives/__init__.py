"""Collective algorithms over a Transport (ring reduce-scatter / allgather) and their helpers."""
