"""Where kvserve keeps what it makes once per machine (converted weights, built kernels)."""

from __future__ import annotations

import os
from pathlib import Path


def default_cache_dir() -> Path:
    """$XDG_CACHE_HOME/kvserve, else ~/.cache/kvserve."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvserve"
