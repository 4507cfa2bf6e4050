"""Moved to ``studies.device.collective_check`` (the source tree's studies/, not the installed
package).

A temporary re-export for the tests that still import it from here; it works only from a source
checkout (where ``studies`` is importable) and goes away once they import the new path."""
from studies.device.collective_check import (  # noqa: F401
    KFAC_LAYOUT,
    OnBackend,
    collective_checks,
    random_kfac_geometry,
)
