"""Moved to ``studies.device.edge_cases`` (the source tree's studies/, not the installed package).

A temporary re-export for the tests that still import it from here; it works only from a source
checkout (where ``studies`` is importable) and goes away once they import the new path."""
from studies.device.edge_cases import (  # noqa: F401
    BLOCKS,
    LENGTHS,
    edge_vectors,
    floats_equal,
    messages_equal,
    random_vector,
)
