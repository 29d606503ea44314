"""The folder where a benchmark's servers and workers write their logs.

With ``--log-dir`` the logs go there and stay. Without it they go to a fresh temporary
folder that is removed when the run ends well and kept when it did not (an exception,
or a part of the run reported absent), with its path printed, so the logs that explain
a failure are still there. Before this, every run left its folder behind: 122
``/tmp/kvpool-bench-*`` folders after two days of benchmarking on the development VM.
"""

from __future__ import annotations

import shutil
import sys
import tempfile

from kvpool.config import make_output_folder


class RunLogs:
    """Context manager giving ``path``, the logs' folder (a str).

    ``given``: the user's ``--log-dir`` (None: a temporary folder named ``prefix``...);
    ``flag``: the option's name for errors. Raises UserError when ``given`` cannot be
    made or written. On exit a temporary folder is removed unless :meth:`keep` was
    called or the block raised; a line on stderr then says where the logs are."""

    def __init__(self, given: str | None, prefix: str, flag: str = "--log-dir"):
        self.temporary = not given
        self.path = tempfile.mkdtemp(prefix=prefix) if self.temporary else make_output_folder(flag, given)
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
            print(f"logs kept in {self.path} ({self.why})", file=sys.stderr)
        else:
            shutil.rmtree(self.path, ignore_errors=True)
