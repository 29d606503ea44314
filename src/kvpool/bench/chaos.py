"""``kvpool bench chaos``: steady verified load while nodes, clients and the leader die.

Layout: three hosts (network namespaces on a bridge, :mod:`kvpool.netns`, where
permitted: masters on hosts 0 and 1, etcd on host 2, a node on each, clients in turn;
else processes on loopback), an etcd server, two HA masters
(:mod:`kvpool.master.election`), three nodes and ``--clients`` client processes. Each client
puts values of 1..32 KiB with ``replica_num=2`` and reads back its own committed keys at
random; every value carries its key and a checksum (:func:`encode_value`), so a read
that returns another key's bytes, or torn bytes, is caught. Clients report each commit
(with the segments holding its replicas, from a query after the put) and each key they
are about to remove (their live set is bounded) as JSON lines. A prober in this
process puts, gets and removes a small key every :data:`PROBE_S` seconds.

At random intervals (seeded) one of node / client / leader is killed with SIGKILL and
started again (a node with a new, empty segment; the leader as a standby, after the
other master took over), or a node is paused (SIGSTOP, :data:`PAUSE_S`) and the leader
killed before it resumes: the new leader rebuilds from an index stream that lagged,
which must lose nothing acknowledged. Counted:

- ``wrong_bytes``: reads that returned bytes failing the check (must be 0);
- ``lost``: committed keys (not being removed) with a replica on a segment still
  mounted at the end, that cannot be read back whole at the end (must be 0);
- ``outage_s`` per kill: from the kill to the prober's next success;
- ``leaked_bytes``: after everything is removed and every timeout (read leases, put
  release) has passed, bytes the master still counts as used (must be 0).

Output: a table, ``--json`` and ``--plot`` (PNG) like the other bench commands; the
exit status is 1 when a count that must be 0 is not.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

import xxhash

from kvpool.child import pause_process, stop_ladder

HELP = "kill nodes, clients and the leader under verified load; count wrong bytes and lost objects"
SCHEMA = "kvpool.bench.chaos/1"
PROBE_S = 0.05
LIVE_MAX = 200  # committed keys a client keeps before removing its oldest
MAGIC = b"KVCH"
_HEAD = struct.Struct("<4sHIQ")  # magic, key length, payload length, xxh3_64(key + payload)
MASTER_ARGS = ["--client-ttl", "5", "--default-kv-lease-ttl", "1000", "--put-start-discard-timeout", "2",
               "--put-start-release-timeout", "3"]
KINDS = ("leader", "node", "client", "pause")
PAUSE_S = 0.8  # a "pause": a node stopped this long, then the leader killed before it resumes


def encode_value(key: str, payload: bytes) -> bytes:
    """A value that proves which key it belongs to: header + key + payload."""
    k = key.encode()
    return _HEAD.pack(MAGIC, len(k), len(payload), xxhash.xxh3_64_intdigest(k + payload)) + k + payload


def check_value(key: str, value: bytes) -> bool:
    """True when ``value`` is a whole, unaltered value of ``key`` (:func:`encode_value`)."""
    if len(value) < _HEAD.size:
        return False
    magic, klen, plen, digest = _HEAD.unpack_from(value)
    body = value[_HEAD.size:]
    return (magic == MAGIC and len(body) == klen + plen and body[:klen] == key.encode()
            and xxhash.xxh3_64_intdigest(body) == digest)


def add_arguments(parser) -> None:
    parser.add_argument("--minutes", type=float, default=2.0, help="length of the chaos phase")
    parser.add_argument("--seed", type=int, default=1, help="seed of the kill schedule and the load")
    parser.add_argument("--clients", type=int, default=2, help="client processes putting and getting")
    parser.add_argument("--gap", type=float, default=6.0, help="mean seconds between kills")
    parser.add_argument("--lease-ttl", type=int, default=2, help="the masters' etcd lease, seconds")
    parser.add_argument("--hosts", choices=("netns", "loopback", "auto"), default="auto",
                        help="three hosts as network namespaces on a bridge (root), or processes on "
                             "loopback; auto: namespaces where permitted")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report here")
    parser.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of outages and counts")


@dataclass
class Kill:
    what: str  # leader | node | client | pause (a node paused, the leader killed meanwhile)
    at_s: float  # seconds since the start of the chaos phase
    outage_s: float | None = None  # kill -> the prober's next success (None: never)


@dataclass
class Report:
    schema: str = SCHEMA
    layout: str = ""  # where the hosts are: network namespaces, or loopback (and why)
    seed: int = 0
    minutes: float = 0.0
    kills: list[Kill] = field(default_factory=list)
    committed: int = 0  # commits reported by clients
    checked: int = 0  # committed keys with a surviving replica, read at the end
    without_replica: int = 0  # committed keys whose every replica's node was killed
    wrong_bytes: int = 0
    lost: int = 0
    lost_keys: list[str] = field(default_factory=list)
    leaked_bytes: int = 0
    client_ops: dict = field(default_factory=dict)  # summed counters of the client processes
    lost_leads: int = 0  # leaders that lost their lease unkilled (a busy machine), restarted
    probe_failures: int = 0

    @property
    def ok(self) -> bool:
        return self.wrong_bytes == 0 and self.lost == 0 and self.leaked_bytes == 0


def run(args) -> int:
    from kvpool.errors import UserError

    if not args.minutes > 0 or args.clients < 1 or not args.gap > 0:
        raise UserError("--minutes and --gap must be > 0 and --clients >= 1")
    report = chaos(args.minutes, args.seed, args.clients, args.gap, args.lease_ttl, args.hosts, progress=print)
    print(format_report(report))
    if args.json_path:
        with open(args.json_path, "w") as f:
            json.dump({**asdict(report), "ok": report.ok}, f, indent=1)
    if args.plot_path:
        plot(report, args.plot_path)
    return 0 if report.ok else 1


# ---------------------------------------------------------------- client processes


def worker_main(argv: list[str]) -> None:
    """A client process: ``MASTER_SPEC NAME SEED``; JSON lines on stdout."""
    from kvpool.client import Client
    from kvpool.errors import KVPoolError, ObjectNotFound

    spec, name, seed = argv[0], argv[1], int(argv[2])
    rng = random.Random(seed)
    ops = {"puts": 0, "put_errors": 0, "gets": 0, "get_misses": 0, "get_errors": 0, "wrong": 0}
    live: list[str] = []
    say = lambda **m: print(json.dumps(m), flush=True)  # noqa: E731 (one line per message)
    with Client(spec, timeout_s=5.0) as c:
        n = 0
        last = time.monotonic()
        while True:
            n += 1
            key = f"{name}/{n}"
            try:
                c.put(key, encode_value(key, rng.randbytes(rng.randint(1 << 10, 32 << 10))), replica_num=2)
                h = c.query(key)
                c.release([h])
                ops["puts"] += 1
                live.append(key)
                say(op="commit", key=key, segs=sorted({r.segment.name for r in h.replicas}))
            except KVPoolError:
                ops["put_errors"] += 1
            for key in rng.sample(live, min(2, len(live))):
                try:
                    ok = check_value(key, c.get(key))
                    ops["gets"] += 1
                    if not ok:
                        ops["wrong"] += 1
                        say(op="wrong", key=key)
                except ObjectNotFound:
                    ops["get_misses"] += 1
                except KVPoolError:
                    ops["get_errors"] += 1
            if len(live) > LIVE_MAX:
                key = live.pop(0)
                say(op="removing", key=key)
                try:
                    c.remove(key, force=True)
                except KVPoolError:
                    pass  # gone already, or the master changed: the key is no longer expected
            if time.monotonic() - last > 1.0:
                last = time.monotonic()
                say(op="ops", **ops)
            time.sleep(0.01)


class Clients:
    """The client processes and what they reported."""

    def __init__(self, spec: str, seed: int, places: list[tuple[str, ...]]):
        self.spec, self.seed = spec, seed
        self.prefixes = places  # command prefix per client host, used in turn
        self.procs: dict[str, subprocess.Popen] = {}
        self.committed: dict[str, list[str]] = {}  # key -> segments of its replicas
        self.ops: dict[str, dict] = {}  # client name -> its last counters
        self.wrong = 0
        self._lock = threading.Lock()
        self._started = 0

    def start(self) -> str:
        from kvpool.child import kvpool_env, spawn

        self._started += 1
        name = f"c{self._started}"
        prefix = self.prefixes[self._started % len(self.prefixes)]
        proc = spawn([*prefix, sys.executable, "-m", "kvpool.bench.chaos", self.spec, name,
                      str(self.seed * 1000 + self._started)],
                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL,
                     env=kvpool_env(), text=True)
        self.procs[name] = proc
        threading.Thread(target=self._read, args=(name, proc), daemon=True).start()
        return name

    def _read(self, name: str, proc: subprocess.Popen) -> None:
        for line in proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if msg["op"] == "commit":
                    self.committed[msg["key"]] = msg["segs"]
                elif msg["op"] == "removing":
                    self.committed.pop(msg["key"], None)
                elif msg["op"] == "wrong":
                    self.wrong += 1
                elif msg["op"] == "ops":
                    self.ops[name] = {k: v for k, v in msg.items() if k != "op"}

    def kill(self, rng: random.Random) -> None:
        name = rng.choice(sorted(n for n, p in self.procs.items() if p.poll() is None))
        stop_ladder(self.procs[name], kill=True)

    def stop(self) -> None:
        for proc in self.procs.values():
            stop_ladder(proc, kill=True)

    def summed_ops(self) -> dict:
        total: dict[str, int] = {}
        for counters in self.ops.values():
            for k, v in counters.items():
                total[k] = total.get(k, 0) + v
        return total


# ---------------------------------------------------------------- the prober


class Prober:
    """Puts, gets and removes one small key every :data:`PROBE_S` s; remembers when it
    last succeeded."""

    def __init__(self, spec: str):
        from kvpool.client import Client

        self.client = Client(spec, timeout_s=2.0)
        self.successes: list[tuple[float, float]] = []  # (start, end) of each probe that passed
        self.failures = 0
        self.wrong = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from kvpool.errors import KVPoolError

        n = 0
        while not self._stop.wait(PROBE_S):
            n += 1
            key = f"probe/{n}"
            started = time.monotonic()
            try:
                self.client.put(key, encode_value(key, b"p" * 512))
                ok = check_value(key, self.client.get(key))
                self.client.remove(key, force=True)
            except KVPoolError:
                self.failures += 1
                continue
            if ok:
                self.successes.append((started, time.monotonic()))
            else:
                self.wrong += 1

    def next_success_after(self, t: float) -> float | None:
        """When the first probe started after ``t`` passed (None: none yet); a probe
        begun before ``t`` proves nothing about service after it."""
        return next((end for start, end in self.successes if start > t), None)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)
        self.client.close()


# ---------------------------------------------------------------- the run


def _kill_one(what: str, group, clients: Clients, rng: random.Random) -> float:
    """SIGKILL one ``what`` and start it again; returns when it was killed (monotonic s)."""
    if what in ("leader", "pause"):
        paused = _pause_node(group, rng) if what == "pause" else None
        try:
            i = group.wait_leader()
            killed = time.monotonic()
            group.masters[i].stop(kill=True)
        finally:  # the paused node's index stream lagged by PAUSE_S of commits at the kill
            if paused is not None:
                os.kill(paused, signal.SIGCONT)
        group.wait_leader()  # the standby took over: the old one comes back as a standby
        group.start_master(i)
    elif what == "node":
        i = rng.choice([i for i, n in enumerate(group.nodes) if n.proc.poll() is None])
        killed = time.monotonic()
        group.nodes[i].stop(kill=True)
        group.start_node(group.node_places[i])  # on the same host
    else:
        killed = time.monotonic()
        clients.kill(rng)
        clients.start()
    return killed


def _pause_node(group, rng: random.Random) -> int:
    """SIGSTOP a live node for :data:`PAUSE_S` (its index stream goes unread while the
    clients commit); returns its pid, still stopped."""
    pid = rng.choice([n.proc.pid for n in group.nodes if n.proc.poll() is None])
    pause_process(pid)
    time.sleep(PAUSE_S)
    return pid


@contextlib.contextmanager
def _layout(hosts: str, seed: int):
    """(HAGroup places, client prefixes, what the report calls the layout): three
    namespaces (masters on hosts 0 and 1, etcd on host 2, a node on each, clients in
    turn; this process joins the bridge for its prober), or all on loopback."""
    from kvpool import netns

    why = netns.unavailable() if hosts != "loopback" else "--hosts loopback"
    if why is not None:
        if hosts == "netns":
            from kvpool.errors import UserError

            raise UserError(f"--hosts netns: {why}")
        yield None, [()], f"processes on loopback ({why})"
        return
    with netns.Hosts(f"kvc{os.getpid() % 100000}", 3, net=200 + seed % 50, join_caller=True) as h:
        place = [(h.prefix(i), h.addr(i)) for i in range(3)]
        yield ({"etcd": place[2], "masters": place[:2], "nodes": place},
               [h.prefix(i) for i in range(3)], "3 network namespaces on a bridge")


def chaos(minutes: float, seed: int, num_clients: int = 2, gap_s: float = 6.0, lease_ttl_s: int = 2,
          hosts: str = "auto", progress=lambda text: None) -> Report:
    """Run the chaos phase for ``minutes`` and verify; see the module docstring.
    ``hosts``: "netns", "loopback" or "auto" (namespaces where permitted)."""
    from kvpool.launch_ha import HAGroup

    rng = random.Random(seed)
    report = Report(seed=seed, minutes=minutes)
    with _layout(hosts, seed) as (places, client_prefixes, report.layout), \
            HAGroup(masters=2, num_nodes=3, segment_size="64MiB", lease_ttl_s=lease_ttl_s,
                    master_args=MASTER_ARGS, places=places) as group:
        progress(f"chaos: {report.layout}")
        clients = Clients(group.master_spec, seed, client_prefixes)
        for _ in range(num_clients):
            clients.start()
        prober = Prober(group.master_spec)
        try:
            start = time.monotonic()
            end = start + minutes * 60
            order: list[str] = []
            while True:
                wait = rng.uniform(0.5 * gap_s, 1.5 * gap_s)
                if time.monotonic() + wait > end:
                    break
                time.sleep(wait)
                if not order:
                    order = rng.sample(KINDS, len(KINDS))  # every kind once per round
                what = order.pop()
                t = _kill_one(what, group, clients, rng)
                kill = Kill(what, round(t - start, 2))
                progress(f"chaos: kill -9 {what} at {kill.at_s:.1f} s")
                report.kills.append(kill)
                kill.outage_s = _outage(prober, t)
            time.sleep(max(0.0, end - time.monotonic()))
            clients.stop()
            prober.stop()
            _verify(group, clients, report, lease_ttl_s)
        finally:
            clients.stop()
            prober.stop()
        report.probe_failures = prober.failures
        report.wrong_bytes += clients.wrong + prober.wrong
        report.client_ops = clients.summed_ops()
        report.lost_leads = group.lost_leads
    return report


def _outage(prober: Prober, t: float, timeout_s: float = 60.0) -> float | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        s = prober.next_success_after(t)
        if s is not None:
            return round(s - t, 3)
        time.sleep(PROBE_S)
    return None


def _verify(group, clients: Clients, report: Report, lease_ttl_s: int) -> None:
    """Read back every committed key with a surviving replica, then remove everything
    and wait out the timeouts: what stays used is leaked."""
    from kvpool.client import Client
    from kvpool.errors import KVPoolError

    with Client(group.master_spec, timeout_s=10.0) as c:
        alive = {n.info["segment"] for n in group.nodes if n.proc.poll() is None}
        deadline = time.monotonic() + 30  # killed nodes' segments go after --client-ttl
        while {s.name for s in c.stats().segments} != alive and time.monotonic() < deadline:
            time.sleep(0.1)
        mounted = {s.name for s in c.stats().segments} & alive
        report.committed = len(clients.committed)
        for key, segs in clients.committed.items():
            if not mounted.intersection(segs):
                report.without_replica += 1
                continue
            report.checked += 1
            try:
                ok = check_value(key, c.get(key))
            except KVPoolError:
                ok = None
            if ok is False:
                report.wrong_bytes += 1
            elif ok is None:
                report.lost += 1
                report.lost_keys.append(key)
        c.remove_all(force=True)
        deadline = time.monotonic() + 3 + 1 + lease_ttl_s + 5  # put release + read lease + slack
        while c.stats().used_bytes and time.monotonic() < deadline:
            time.sleep(0.1)
        report.leaked_bytes = c.stats().used_bytes


# ---------------------------------------------------------------- output


def format_report(r: Report) -> str:
    lines = [f"chaos run: {r.minutes:g} min, seed {r.seed}, {len(r.kills)} kills, {r.layout}"]
    for k in r.kills:
        out = "no service since" if k.outage_s is None else f"{k.outage_s:.2f} s without service"
        lines.append(f"  {k.at_s:7.1f} s  kill -9 {k.what:<6}  {out}")
    lines += [f"committed {r.committed}, checked {r.checked}, without a surviving replica {r.without_replica}",
              f"wrong bytes returned: {r.wrong_bytes}   lost: {r.lost}   leaked bytes: {r.leaked_bytes}",
              f"client ops: {r.client_ops}   probe failures: {r.probe_failures}   "
              f"leaders that lost their lease unkilled: {r.lost_leads}",
              "PASS" if r.ok else "FAIL"]
    return "\n".join(lines)


def plot(r: Report, path: str) -> str:
    from kvpool.bench.plot import Panel, save_panels

    labels = [f"{i + 1} {k.what}" for i, k in enumerate(r.kills)]
    panels = [
        Panel("seconds without service after each kill -9", labels,
              {"outage": [k.outage_s for k in r.kills]}, ylabel="s"),
        Panel("counts (wrong, lost, leaked must be 0)", ["committed", "checked", "no replica left", "wrong",
                                                          "lost", "leaked KiB"],
              {"run": [r.committed, r.checked, r.without_replica, r.wrong_bytes, r.lost, r.leaked_bytes / 1024]}),
    ]
    return save_panels(path, panels, f"kvpool bench chaos, seed {r.seed}")


if __name__ == "__main__":
    worker_main(sys.argv[1:])
