"""The folder where a benchmark's servers and workers write their logs.

With ``--log-dir`` the logs go there and stay. Without it they go to a fresh temporary
folder that is removed when the run ends well and kept when it did not (an exception,
or a part of the run reported absent), with its path printed, so the logs that explain
a failure are still there. The temporary folder is a :class:`~kvpool.owned_dir.OwnedDir`,
as a launcher's is. Before this, every run left its folder behind: 122
``/tmp/kvpool-bench-*`` folders after two days of benchmarking on the development VM.
"""

from __future__ import annotations

import sys

from kvpool.config import make_output_folder
from kvpool.owned_dir import OwnedDir


class RunLogs:
    """Context manager giving ``path``, the logs' folder (a str).

    ``given``: the user's ``--log-dir`` (None: a temporary folder named ``prefix``...);
    ``flag``: the option's name for errors. Raises UserError when ``given`` cannot be
    made or written. On exit a temporary folder is removed unless :meth:`keep` was
    called or the block raised; a line on stderr then says where the logs are."""

    def __init__(self, given: str | None, prefix: str, flag: str = "--log-dir"):
        self._owned = None if given else OwnedDir(prefix)  # a temporary folder, locked while in use
        self.temporary = self._owned is not None
        self.path = str(self._owned.path) if self._owned else make_output_folder(flag, given)
        self.why: str | None = None

    def keep(self, why: str) -> None:
        """Keep a temporary folder after the run: ``why`` (e.g. "a column was absent")
        is printed with its path."""
        self.why = self.why or why

    def __enter__(self) -> "RunLogs":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.keep("the run failed")
        if not self.temporary:
            print(f"logs in {self.path}", file=sys.stderr)
        elif self.why:
            self._owned.keep()
            print(f"logs kept in {self.path} ({self.why})", file=sys.stderr)
        else:
            self._owned.remove()
