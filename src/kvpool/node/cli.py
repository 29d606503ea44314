"""``kvpool node``: run a storage node (one shared-memory segment) for a master."""

from __future__ import annotations

import errno
import logging
import os
from decimal import Decimal

from kvpool.child import stop_on_signals, stop_requested, wait_for_stop
from kvpool.config import Option, add_options, check_output_path, parse_bool, positive, parse_host, parse_size, resolve, write_ready_file
from kvpool.local_socket import WILDCARDS
from kvpool.errors import UserError
from kvpool.masters import DEFAULT_MASTER_PORT, check_spec
from kvpool.node.data_server import MAX_CONNECTIONS, STALL_S
from kvpool.spin import BUSY_POLL_US

HELP = "run a kvpool storage node: a shared-memory segment mounted with the master"


def _addr(text) -> str:
    return check_spec(str(text), default_port=DEFAULT_MASTER_PORT)


# Mooncake refuses segments under its MIN_SEGMENT_SIZE (1 KiB); a node asks for 1 MiB:
# anything smaller holds no useful KV page and is almost surely a missing unit ("1" for 1GiB)
MIN_NODE_SEGMENT = 1 << 20


def segment_size(text) -> int:
    """A node's segment size in bytes from text like "64MiB". Raises ValueError under
    :data:`MIN_NODE_SEGMENT`, UserError for text that is not a size."""
    size = parse_size(text)
    if size < MIN_NODE_SEGMENT:
        raise ValueError(f"a segment must be at least 1MiB, got {size} bytes "
                         f"(sizes take a unit: 64MiB, 1GiB)")
    return size


SHM_DIR = "/dev/shm"


def _mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (Linux proc(5)); None where absent."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_fits(size: int, prefault: bool) -> None:
    """Refuse a segment this machine cannot hold, before anything starts.

    A segment is a file in /dev/shm: it can never grow past that filesystem's free
    space; prefaulted, its pages are also taken from memory at once, so it must fit in
    MemAvailable too. Raises: UserError saying what was asked and what is available.
    """
    try:
        st = os.statvfs(SHM_DIR)
        limits = [(st.f_bavail * st.f_frsize, f"free in {SHM_DIR}")]
    except OSError:
        limits = []
    available = _mem_available()
    if prefault and available is not None:
        limits.append((available, "memory available"))
    for free, what in limits:
        if size > free:
            raise UserError(f"--segment-size {_gib(size)} does not fit: only {_gib(free)} {what}")


def _gib(n: int) -> str:
    if n >= 1 << 60:  # a typo's size: no forty digits of float noise
        return f"{Decimal(n >> 30):.3g} GiB"  # Decimal: beyond a float's range too
    return f"{n / (1 << 30):,.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):,.1f} MiB"


OPTIONS = [
    Option("master", f"127.0.0.1:{DEFAULT_MASTER_PORT}", _addr, "master address host:port or [v6]:port; HA masters: "
           "host:port,host:port or etcd://host:2379[/key] (the leader named in etcd)", env="MASTER"),
    Option("host", "127.0.0.1", parse_host, "address of the TCP data server: a name, IPv4 or IPv6 (::1)",
           env="NODE_HOST"),
    Option("port", 0, int, "TCP data port (0 = a free port, distinct per node)", env="NODE_PORT"),
    Option("segment-size", "1GiB", segment_size, "shared-memory segment size, e.g. 64MiB, 1GiB"),
    Option("prefault", "yes", parse_bool, "allocate every page of the segment at start (yes|no)"),
    Option("http-port", None, int, "admin HTTP port: /health /metrics (0 = a free port; unset = none)",
           env="NODE_HTTP_PORT"),
    Option("secret", "", str, "shared secret: asked of data-port peers, proven to the master "
           "(empty = none; prefer the env var or a config file: flags show in ps)", env="SECRET"),
    Option("master-wait", 30.0, positive(float, zero_ok=True), "seconds to keep trying a master that does not "
           "accept connections yet at start (0 = fail at once)"),
    Option("frame-timeout", STALL_S, positive(float), "seconds a data-port peer may pause mid-frame "
           "before its connection is closed (up to twice that when it stopped just after sending part)"),
    Option("max-connections", MAX_CONNECTIONS, positive(int), "data-port connections served at once "
           "(a thread each); past it the longest idle one is closed (its client reconnects)"),
    Option("busy-poll", BUSY_POLL_US, positive(int, zero_ok=True), "microseconds a data connection keeps "
           "polling for its next request after answering a read, while its requests come that quickly (0 = never)",
           env="NODE_BUSY_POLL"),
]


def add_arguments(parser) -> None:
    add_options(parser, OPTIONS)
    parser.add_argument("--ready-file", default=None, help="write {\"addr\": ...} JSON here once mounted")


def run(args) -> int:
    from kvpool.node.segment_host import SegmentHost
    from kvpool.rpc import MasterUnreachable

    values = resolve(args, OPTIONS)
    if values["host"] in WILDCARDS:  # clients would connect to 0.0.0.0: their own host
        raise UserError(f"--host {values['host']}: a node announces its --host to clients as its data "
                        "address; give the address of the interface the other machines reach")
    size = segment_size(values["segment_size"])
    check_fits(size, values["prefault"])
    check_output_path("--ready-file", args.ready_file)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s node %(levelname)s %(message)s")
    node = SegmentHost(values["master"], values["host"], values["port"], size, values["prefault"],
                       stall_s=values["frame_timeout"], secret=values["secret"].encode(),
                       max_connections=values["max_connections"],
                       master_wait_s=values["master_wait"], busy_poll_s=values["busy_poll"] / 1e6)
    # a stop signal is only recorded, and the waits here look for it: an Event set from
    # the handler can deadlock a main thread that holds the Event's lock
    with stop_on_signals():
        admin, http_addr = None, None
        try:
            try:
                node.start(stop_asked=stop_requested)
            except MasterUnreachable:
                if stop_requested():  # Ctrl-C or SIGTERM while waiting for the master
                    return 0
                raise
            if values["http_port"] is not None:  # kvpool.node.admin, served from a thread of its own
                from kvpool.node.admin import NodeAdmin

                admin = NodeAdmin(node, values["host"], values["http_port"])
                http_addr = admin.start()
            print(f"kvpool node serving segment {node.info.name} ({size} bytes) on {node.data_addr}, "
                  f"master {values['master']}", flush=True)
            if args.ready_file:
                write_ready_file(args.ready_file, {
                    "addr": node.data_addr, "segment": node.info.name, "owner_id": node.owner_id,
                    "shm_name": node.info.shm_name, "pid": os.getpid(), "http_addr": http_addr,
                })
            wait_for_stop(float("inf"))
        except OSError as exc:  # creating the segment: memory taken by others since check_fits
            if exc.errno not in (errno.ENOMEM, errno.ENOSPC):
                raise
            raise UserError(f"cannot create a {_gib(size)} segment: {exc.strerror} "
                            f"({_gib(_mem_available() or 0)} memory available)") from None
        finally:
            if admin is not None:
                admin.stop()
            node.stop()
    return 0
