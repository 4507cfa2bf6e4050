"""Workloads for end-to-end runs: a compact Llama-style decoder (``llama``) and a byte-level text
corpus built from the Python standard library's own sources (``corpus``)."""
