"""The progress bar of the cache benchmarks (tqdm on stderr, imported only when shown)."""

from __future__ import annotations

import sys


def progress_bar(total: int, disabled: bool):
    """A tqdm bar of ``total`` requests on stderr, or None when ``disabled``."""
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", file=sys.stderr, mininterval=0.5)
