"""``kvpool serve``: a master and one node in the foreground (single-machine default).

Both run as child processes through :class:`kvpool.launch.Cluster`; the addresses are
printed once both are up; Ctrl-C (or SIGTERM) stops both and unlinks the segment.
"""

from __future__ import annotations

import signal
import threading

from kvpool.config import Option, add_options, parse_size, resolve

HELP = "run a master and one storage node together (Ctrl-C stops both)"

OPTIONS = [
    Option("port", 50051, int, "master control port (0 = any free port)", env="MASTER_PORT"),
    Option("segment-size", "1GiB", parse_size, "the node's shared-memory segment size"),
    Option("default-kv-lease-ttl", 10_000, int, "read lease granted by get/exist, ms"),
    Option("http-port", None, int, "master admin HTTP port, /health /metrics ... (0 = a free port; unset = none)",
           env="MASTER_HTTP_PORT"),
]


def add_arguments(parser) -> None:
    add_options(parser, OPTIONS)
    parser.add_argument("--ready-file", default=None, help="write {\"addr\": master, \"nodes\": [...]} JSON here once up")


def run(args) -> int:
    from kvpool.config import write_ready_file
    from kvpool.launch import Cluster

    values = resolve(args, OPTIONS)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Cluster(segment_size=values["segment_size"], lease_ttl_ms=values["default_kv_lease_ttl"],
                 master_port=values["port"],
                 extra_master_args=() if values["http_port"] is None else ("--http-port", values["http_port"])) as cluster:
        print(f"kvpool master: {cluster.master_addr}", flush=True)
        if cluster.master.info.get("http_addr"):
            print(f"kvpool admin:  http://{cluster.master.info['http_addr']}/metrics", flush=True)
        for info in cluster.nodes:
            print(f"kvpool node:   {info['addr']} (segment {info['segment']}, "
                  f"{values['segment_size']} bytes)", flush=True)
        print("Ctrl-C to stop.", flush=True)
        if args.ready_file:
            write_ready_file(args.ready_file, {"addr": cluster.master_addr, "nodes": cluster.node_addrs})
        while not stop.wait(0.5):
            if any(c.proc.poll() is not None for c in cluster.children):
                print("kvpool serve: a child process exited; stopping", flush=True)
                return 1
    return 0
