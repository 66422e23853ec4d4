"""matplotlib, when it is there: plots are an extra (``pip install 'plaserve[plots]'``); without it every
command still runs and writes its tables, and says once that it made no plots."""

from __future__ import annotations

import logging
from types import ModuleType

log = logging.getLogger(__name__)
_warned = False


def pyplot() -> ModuleType | None:
    """``matplotlib.pyplot`` on the file-only Agg backend (no display needed; safe in a server or a
    test), or None when matplotlib is not installed."""
    global _warned
    try:
        import matplotlib
    except ImportError:
        if not _warned:
            log.warning("matplotlib is not installed: no plots (pip install 'plaserve[plots]')")
            _warned = True
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
