"""Running the ``kvpool`` command of this checkout in a subprocess, as a user would.

``python -m kvpool`` in a child imports whatever kvpool its sys.path finds first (an
editable install may point at another checkout), so the child gets this checkout's
``src`` first on PYTHONPATH.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import kvpool

SRC = str(Path(kvpool.__file__).resolve().parents[1])
KVPOOL = [sys.executable, "-m", "kvpool"]


def kvpool_env(**extra: str) -> dict:
    """os.environ with this checkout's src first on PYTHONPATH, offline HF, plus ``extra``."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **extra}
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    return env
