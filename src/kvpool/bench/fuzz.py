"""``kvpool bench fuzz``: hostile inputs against a live cluster, a well-behaved client
checked throughout.

Targets, each fed ``--inputs`` generated inputs (hypothesis, generation phase only):

============  ==============================================================================
master        the control port: request frames of every type with mutated fields (any
              msgpack value in a field, fields dropped or added), mutated headers (length,
              magic, version), raw bytes, up to three per connection
node          a data port (of node 0; the checker's objects live on node 1, since writing
              raw bytes into a segment is what the data port is for): data-plane frames
              mutated the same way, raw bytes
master-http   the master's admin HTTP server: requests to its endpoints and others with
              generated methods, paths, query strings and headers, raw bytes
node-http     the node's admin HTTP server, the same way
============  ==============================================================================

Each input goes over a fresh connection, which the fuzzer half-closes after sending
(the server then sees EOF instead of waiting out the frame timeout) and reads until
the server closes it. Meanwhile a checker thread puts a fresh value, reads it back,
compares the bytes and pings, over and over: its worst round trip is the worst stall a
well-behaved client saw. A wrong answer, or a request that fails other than by a state
the fuzz inputs may legally have caused (an object removed by a fuzzed RemoveAll, a
full segment), is an error. The servers' RSS is sampled by the checker; a server that
exits is a crash. The run passes with no crash and no error.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import typing
from dataclasses import asdict, dataclass, field

import msgspec
import msgspec.inspect as mi

from kvpool import protocol as P

HELP = "fuzz the master, a node and both admin HTTP servers with generated inputs (hypothesis)"
TARGETS = ("master", "node", "master-http", "node-http")
IO_TIMEOUT_S = 5.0  # a reply that has not come by then counts as a stall, not a hang
CHECK_VALUE = 4096  # bytes of each value the checker puts and reads back
PROGRESS_EVERY = 10_000  # inputs between progress lines
CHECK_PAUSE_S = 0.01  # between checks: the checker must not starve the fuzzer (one GIL)
HTTP_PATHS = ("/health", "/metrics", "/segments", "/keys", "/query_key", "/", "/nope", "/keys/../metrics")


def add_arguments(parser) -> None:
    parser.add_argument("--inputs", type=int, default=100_000,
                        help="generated inputs per target (the default on all 4 targets ran about 21 min "
                        "on a 2-core machine; a progress line every 10,000 inputs)")
    parser.add_argument("--targets", default=",".join(TARGETS), help=f"comma-separated subset of {TARGETS}")
    parser.add_argument("--json", default=None, help="write the report here as JSON")


def run(args) -> int:
    from kvpool.errors import UserError

    targets = [t for t in args.targets.split(",") if t]
    unknown = sorted(set(targets) - set(TARGETS))
    if unknown or args.inputs < 1:
        raise UserError(f"--targets takes {', '.join(TARGETS)} (got {', '.join(unknown)}); --inputs >= 1")
    report = fuzz(args.inputs, targets, progress=print)
    text = json.dumps(asdict(report), indent=1)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            f.write(text)
    return 0 if report.ok else 1


@dataclass
class Report:
    """What a fuzz run did: ``inputs`` per target, ``crashes`` (server processes that
    exited), checker ``checks`` and ``errors`` (wrong answers, failed requests),
    ``tolerated`` (checker requests refused for a state fuzz inputs may cause),
    ``worst_stall_s`` (the checker's slowest check after the first: put, get, ping), ``peak_rss`` bytes per process."""

    inputs: dict[str, int] = field(default_factory=dict)
    crashes: list[str] = field(default_factory=list)
    checks: int = 0
    errors: list[str] = field(default_factory=list)
    tolerated: int = 0
    worst_stall_s: float = 0.0
    peak_rss: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.crashes and not self.errors and self.checks > 0


# ---------------------------------------------------------------- inputs


def valid_value(t):
    """A valid plain (msgpack-ready) value of msgspec type info ``t``: lower bounds,
    "k", empty lists; a tagged Struct as ``[tag, *fields]``."""
    if isinstance(t, mi.IntType):
        return t.ge if t.ge is not None else 0
    if isinstance(t, mi.StrType):
        return "k"
    if isinstance(t, mi.BoolType):
        return False
    if isinstance(t, mi.ListType):
        return []
    if isinstance(t, mi.StructType):
        return ([t.tag] if t.tag is not None else []) + [valid_value(f.type) for f in t.fields]
    raise TypeError(f"no valid value for {t}")


def _strategies():
    """(control-plane input, data-plane input, HTTP input) hypothesis strategies."""
    from hypothesis import strategies as st

    scalar = (st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats(allow_nan=True)
              | st.text(max_size=40) | st.binary(max_size=40))
    anything = st.recursive(scalar, lambda inner: st.lists(inner, max_size=4), max_leaves=12)

    @st.composite
    def frame(draw, types):
        value = valid_value(mi.type_info(draw(st.sampled_from(types))))
        for _ in range(draw(st.integers(0, 3))):
            if len(value) > 1:
                value[draw(st.integers(1, len(value) - 1))] = draw(anything)
        value = value[: draw(st.integers(0, len(value) + 1))] + draw(st.lists(anything, max_size=1))
        body = msgspec.msgpack.encode(value)
        length = draw(st.sampled_from([len(body)] * 6 + [0, len(body) + 1, P.MAX_FRAME, 2**32 - 1]))
        magic = draw(st.sampled_from([P.MAGIC] * 8 + [P.magic(1), P.magic(9), b"KVPA", b"GET "]))
        cut = draw(st.sampled_from([None] * 6 + [0, 3, 9]))
        return (P.HEADER.pack(magic, length) + body)[:cut]

    def port_input(types):
        return st.lists(frame(types) | st.binary(max_size=256), min_size=1, max_size=3).map(b"".join)

    token = st.text(st.characters(codec="ascii", exclude_characters="\r\n"), max_size=30)
    path = st.sampled_from(HTTP_PATHS) | token.map(lambda t: "/" + t)
    query = st.dictionaries(st.sampled_from(["key", "prefix", "limit", "x"]),
                            token | st.integers().map(str), max_size=3)

    @st.composite
    def http_request(draw):
        method = draw(st.sampled_from(["GET", "POST", "HEAD", "PUT", "DELETE", "OPTIONS"]) | token)
        q = "&".join(f"{k}={v}" for k, v in draw(query).items())
        headers = "".join(f"{k}: {v}\r\n" for k, v in draw(st.dictionaries(token, token, max_size=3)).items())
        body = draw(st.binary(max_size=64))
        return (f"{method} {draw(path)}{'?' + q if q else ''} HTTP/1.1\r\nHost: x\r\n{headers}"
                f"Content-Length: {draw(st.sampled_from([len(body), 0, 10**9]))}\r\n\r\n").encode() + body

    return (port_input(typing.get_args(P.Request)), port_input(typing.get_args(P.DataRequest)),
            http_request() | st.binary(max_size=256))


def send_one(addr: str, data: bytes) -> None:
    """One input over a fresh connection: send, half-close, read until the server
    closes (or IO_TIMEOUT_S passes). Connection errors are the server's right."""
    from kvpool.config import parse_addr

    try:
        with socket.create_connection(parse_addr(addr), timeout=IO_TIMEOUT_S) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            while s.recv(1 << 16):
                pass
    except OSError:
        pass


# ---------------------------------------------------------------- the checker


class Checker(threading.Thread):
    """A well-behaved client: put a fresh value on ``segment``, read it back, ping;
    records the worst round trip, errors and the servers' peak RSS."""

    def __init__(self, master_addr: str, segment: str, pids: dict[str, int], report: Report):
        super().__init__(daemon=True)
        self.master_addr, self.segment, self.pids, self.report = master_addr, segment, pids, report
        self.done = threading.Event()

    def run(self) -> None:
        from kvpool.client import Client
        from kvpool.errors import KVPoolError, NoSpace, ObjectNotFound

        with Client(self.master_addr, timeout_s=30.0) as c:
            n = 0
            while not self.done.is_set():
                n += 1
                key, value = f"fuzz-check-{n}", os.urandom(CHECK_VALUE)
                start = time.monotonic()
                try:
                    c.put(key, value, preferred_segment=self.segment)
                    got = c.get(key)
                    c.ping()
                    if got != value:
                        self.report.errors.append(f"check {n}: wrong bytes read back")
                    c.remove(key, force=True)
                except (ObjectNotFound, NoSpace):
                    self.report.tolerated += 1  # a fuzzed RemoveAll or PutStart got there first
                except KVPoolError as exc:
                    self.report.errors.append(f"check {n}: {type(exc).__name__}: {exc}")
                if n > 1:  # the first check also opens the connections
                    self.report.worst_stall_s = max(self.report.worst_stall_s, time.monotonic() - start)
                self.report.checks = n
                self._sample()
                self.done.wait(CHECK_PAUSE_S)

    def _sample(self) -> None:
        for name, pid in self.pids.items():
            try:
                with open(f"/proc/{pid}/status") as f:
                    rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
            except (OSError, StopIteration):
                continue
            self.report.peak_rss[name] = max(self.report.peak_rss.get(name, 0), rss)


# ---------------------------------------------------------------- the run


def fuzz(inputs: int, targets=TARGETS, progress=lambda line: None) -> Report:
    """Fuzz a fresh two-node cluster (see the module docstring); ``inputs`` per target.
    Returns the :class:`Report`."""
    from hypothesis import HealthCheck, Phase, given, settings

    from kvpool.launch import Cluster

    control, data, http = _strategies()
    report = Report()
    started = time.monotonic()
    timeouts = ("--frame-timeout", "2")
    with Cluster(segment_size="16MiB", num_nodes=2,
                 extra_master_args=("--http-port", "0", *timeouts, "--put-start-discard-timeout", "1",
                                    "--put-start-release-timeout", "2"),
                 extra_node_args=("--http-port", "0", *timeouts)) as cluster:
        addrs = {"master": (cluster.master_addr, control), "node": (cluster.node_addrs[0], data),
                 "master-http": (cluster.master.info["http_addr"], http),
                 "node-http": (cluster.nodes[0]["http_addr"], http)}
        pids = {"master": int(cluster.master.info["pid"]), "node": int(cluster.nodes[0]["pid"])}
        checker = Checker(cluster.master_addr, cluster.nodes[1]["segment"], pids, report)
        checker.start()
        try:
            for target in targets:
                addr, strategy = addrs[target]
                count = [0]

                @settings(max_examples=inputs, database=None, deadline=None, phases=[Phase.generate],
                          suppress_health_check=list(HealthCheck))
                @given(strategy)
                def feed(data_in: bytes) -> None:
                    count[0] += 1
                    send_one(addr, data_in)
                    if count[0] % PROGRESS_EVERY == 0:
                        last = f" (last: {report.errors[-1]})" if report.errors else ""
                        progress(f"fuzz {target}: {count[0]} inputs so far, {len(report.errors)} errors{last}")

                feed()
                report.inputs[target] = count[0]
                progress(f"fuzz {target}: {count[0]} inputs, checker {report.checks} checks, "
                         f"{len(report.errors)} errors, worst stall {report.worst_stall_s:.3f} s")
        finally:
            checker.done.set()
            checker.join(60)
            report.crashes = [c.exit_message() for c in cluster.children if c.proc.poll() is not None]
    report.seconds = round(time.monotonic() - started, 1)
    return report
