"""Start and stop a master and its nodes as child processes (tests, serve, demo, bench).

Each child is ``python -m kvpool master|node ... --ready-file F``; the launcher polls F
(JSON with at least ``{"addr": "host:port"}``) until a deadline, and fails with the
child's log tail if the child exits or the deadline passes. On exit every child is
terminated (nodes first, so they unmount and unlink their shared memory), waited for,
and killed if it does not go. On Linux each child also gets SIGTERM when its parent dies
(``PR_SET_PDEATHSIG``, see :func:`kvpool.child.child_preexec`), so a launcher killed with SIGKILL
leaves no master or node behind holding ports and /dev/shm segments (the process
toolkit is :mod:`kvpool.child`).
"""

from __future__ import annotations

import json
import re
import tempfile
import time
from pathlib import Path

from kvpool.child import ChildProcess, kvpool_cmd, pause
from kvpool.config import parse_size
from kvpool.errors import KVPoolError
from kvpool.owned_dir import OwnedDir, sweep_abandoned

WORKDIR_PREFIX = "kvpool-cluster-"  # a launcher's folder of ready files (and logs) in the temp dir
# a node fills its segment's pages before it is ready (--prefault yes): 0.75-2.9 s per GiB
# on the development VM, so its deadline grows by this much per GiB (a 20 GiB node
# failed `kvpool serve`'s fixed 30 s)
FILL_S_PER_GIB = 5.0
_USAGE_ERROR = re.compile(r"kvpool [\w-]+: error: (.+)")  # kvpool.cli's line for a user's mistake


class LaunchError(KVPoolError):
    """A child process did not come up (its log tail is in the message). ``whole``:
    the message holds all the child said (a one-line CLI error), so no log need be kept."""

    whole = False


class Child(ChildProcess):
    """One started ``kvpool master|node`` process, its ready-file info and its log file.

    It runs in its own process group (a Ctrl-C at the terminal reaches the launcher only,
    which stops its children in order: a child interrupted mid-start would read as failed).
    """

    error = LaunchError

    def __init__(self, kind: str, args: list[str], workdir: Path, log_dir: Path, tag: str, prefix=()):
        self.kind = kind
        self.ready_file = workdir / f"{tag}.ready.json"
        cmd = [*prefix, *kvpool_cmd(kind, *args, "--ready-file", str(self.ready_file))]  # prefix: ip netns exec NS
        super().__init__(kind, cmd, log_dir / f"{tag}.log", group=True)

    def wait_ready(self, timeout_s: float) -> dict:
        """Poll the ready file; returns its JSON (at once when already read). Raises
        LaunchError, with the log's path and tail, as soon as the child has exited, or at
        the timeout; KeyboardInterrupt when a stop signal is recorded
        (:func:`kvpool.child.stop_on_signals`)."""
        if self.info:
            return self.info
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.ready_file.exists():
                self.info = json.loads(self.ready_file.read_text())
                return self.info
            if self.proc.poll() is not None:
                said = self._usage_error()
                if said is not None:  # a user's mistake, already worded: one line, no log to keep
                    error = LaunchError(f"{self.kind}: {said}")
                    error.whole = True
                    raise error
                raise LaunchError(f"{self.kind} exited with {self.proc.returncode} {self._log_said()}")
            pause(0.01)
        raise LaunchError(f"{self.kind} not ready after {timeout_s:g} s {self._log_said()}")

    def _usage_error(self) -> str | None:
        """What the exited child's CLI refused, when that is all its log holds: exit
        status 2 and the one line ``kvpool KIND: error: WHAT`` (returns WHAT)."""
        lines = [line for line in self.log_tail().splitlines() if line.strip()]
        found = _USAGE_ERROR.match(lines[0]) if self.proc.returncode == 2 and len(lines) == 1 else None
        return found.group(1) if found else None

    def _log_said(self) -> str:
        """"(log: PATH):" and the log's tail on the next lines, or that the log is empty."""
        tail = self.log_tail()
        return f"(log: {self.log_path}):\n{tail}" if tail.strip() else f"(its log {self.log_path} is empty)"


class Cluster:
    """A master and ``num_nodes`` nodes on ``host`` (127.0.0.1; ``::1`` for IPv6), as a
    context manager.

    Args:
        segment_size: each node's shared-memory segment ("256MiB" or bytes).
        lease_ttl_ms: the master's --default-kv-lease-ttl.
        extra_master_args / extra_node_args: more command-line flags for the children.
        log_dir: where children's logs go, kept (default: a temporary folder, removed on
            exit unless a child failed: exited on its own with a non-zero status, or did
            not come up; then its path is in the error or :meth:`Child.exit_message`).
        num_nodes: nodes started with the cluster (more with :meth:`start_node`).
        master_port: 0 = any free port.
        startup_timeout_s: deadline for each child's ready file; a node's grows by
            :data:`FILL_S_PER_GIB` per GiB of its segment.
        host: the address master and nodes listen on (``--host``).

    Attributes: ``master_addr`` ("127.0.0.1:PORT", "[::1]:PORT"), ``node_addrs`` (data ports),
    ``nodes`` (ready-file dicts: addr, segment, owner_id, shm_name, pid).
    Raises LaunchError when a child does not come up.
    """

    def __init__(self, segment_size="256MiB", lease_ttl_ms: int = 10_000, extra_master_args=(),
                 log_dir=None, num_nodes: int = 1, extra_node_args=(), master_port: int = 0,
                 startup_timeout_s: float = 30.0, host: str = "127.0.0.1"):
        self.host = host
        self.segment_size = parse_size(segment_size)
        self.lease_ttl_ms = lease_ttl_ms
        self.extra_master_args = [str(a) for a in extra_master_args]
        self.extra_node_args = [str(a) for a in extra_node_args]
        self.num_nodes = num_nodes
        self.master_port = master_port
        self.startup_timeout_s = startup_timeout_s
        sweep_abandoned(tempfile.gettempdir(), WORKDIR_PREFIX)  # those of launchers killed with -9
        self._owned = OwnedDir(WORKDIR_PREFIX)
        self._workdir = self._owned.path
        self.log_dir = Path(log_dir) if log_dir else self._workdir
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.master: Child | None = None
        self.node_children: list[Child] = []
        self._count = 0
        self._master_starts = 0

    @property
    def master_addr(self) -> str:
        return self.master.info["addr"]

    @property
    def node_addrs(self) -> list[str]:
        return [c.info.get("addr", "") for c in self.node_children]

    @property
    def nodes(self) -> list[dict]:
        return [c.info for c in self.node_children]

    def start(self) -> "Cluster":
        """Start the master and the nodes; returns self. Raises LaunchError."""
        try:
            self._start_master(self.master_port)
            for _ in range(self.num_nodes):
                self.start_node()
        except BaseException as exc:
            self.stop(keep_logs=not isinstance(exc, KeyboardInterrupt) and not getattr(exc, "whole", False))
            raise
        return self

    def _start_master(self, port: int) -> None:
        args = ["--host", self.host, "--port", str(port), "--default-kv-lease-ttl", str(self.lease_ttl_ms),
                *self.extra_master_args]
        self._master_starts += 1
        tag = "master" if self._master_starts == 1 else f"master{self._master_starts}"
        self.master = Child("master", args, self._workdir, self.log_dir, tag)
        self.master.wait_ready(self.startup_timeout_s)

    def restart_master(self, kill: bool = True) -> None:
        """Stop the master (SIGKILL by default: a crash; SIGTERM with ``kill=False``) and
        start a new one on the same port with the same flags, as an operator would; the
        nodes keep running. Raises LaunchError if the new master does not come up."""
        port = int(self.master_addr.rsplit(":", 1)[1])
        self.master.stop(kill=kill)
        self._start_master(port)

    def start_node(self, segment_size=None, extra_args=()) -> int:
        """Start one more node; returns its index in ``node_addrs``."""
        size = parse_size(segment_size) if segment_size is not None else self.segment_size
        self._count += 1
        args = ["--master", self.master_addr, "--host", self.host, "--port", "0", "--segment-size", str(size),
                *self.extra_node_args, *[str(a) for a in extra_args]]
        child = Child("node", args, self._workdir, self.log_dir, f"node{self._count}")
        self.node_children.append(child)
        child.wait_ready(self.startup_timeout_s + FILL_S_PER_GIB * size / (1 << 30))
        return len(self.node_children) - 1

    def stop_node(self, index: int, kill: bool = False) -> int | None:
        """Stop node ``index``: SIGTERM (graceful unmount) or SIGKILL (``kill=True``, the
        master notices by heartbeat TTL). Returns its exit status."""
        return self.node_children[index].stop(kill=kill)

    def stop(self, keep_logs: bool | None = None) -> None:
        """Stop nodes (so they unmount and unlink), then the master; remove temp files.

        ``keep_logs``: keep the temporary folder of logs (True), remove it (False), or
        (None) keep it only when a child failed. A ``log_dir`` given is always kept.
        """
        if keep_logs is None:
            keep_logs = any(c.failed for c in self.children)
        for child in self.node_children:
            child.stop()
        if self.master is not None:
            self.master.stop()
        if self.log_dir != self._workdir or not keep_logs:
            self._owned.remove()
        else:
            self._owned.keep()  # the logs of a failed child: no later sweep removes them

    @property
    def children(self) -> list[Child]:
        """Every started process: the master first, then the nodes."""
        return ([self.master] if self.master else []) + self.node_children

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, exc_type, *exc) -> None:
        # an error keeps the logs; Ctrl-C or a clean exit keeps them only if a child failed
        self.stop(keep_logs=True if exc_type and not issubclass(exc_type, KeyboardInterrupt)
                  else None)
