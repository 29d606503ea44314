"""``kvpool serve``: a master and one node in the foreground (single-machine default).

Both run as child processes through :class:`kvpool.launch.Cluster`; the addresses are
printed once both are up; Ctrl-C (or SIGTERM) stops both and unlinks the segment. If
either child exits on its own, serve says which one (master or node, pid, exit status,
its last log lines) and stops the other.
"""

from __future__ import annotations

from kvpool.child import check_stop, stop_on_signals, wait_for_stop
from kvpool.config import Option, add_options, format_size, parse_host, resolve
from kvpool.masters import DEFAULT_MASTER_PORT
from kvpool.node.cli import check_fits, segment_size

HELP = "run a master and one storage node together (Ctrl-C stops both)"
LOG_LINES = 10  # last lines of a dead child's log that serve prints

OPTIONS = [
    Option("host", "127.0.0.1", parse_host, "address master and node listen on: a name, IPv4 or IPv6 (::1)",
           env="MASTER_HOST"),
    Option("port", DEFAULT_MASTER_PORT, int, "master control port (0 = any free port)", env="MASTER_PORT"),
    Option("segment-size", "1GiB", segment_size, "the node's shared-memory segment size (at least 1MiB)"),
    Option("default-kv-lease-ttl", 10_000, int, "read lease granted by get/exist, ms"),
    Option("http-port", None, int, "master admin HTTP port, /health /metrics ... (0 = a free port; unset = none)",
           env="MASTER_HTTP_PORT"),
]


def add_arguments(parser) -> None:
    add_options(parser, OPTIONS)
    parser.add_argument("--ready-file", default=None,
                        help="write {\"addr\": master, \"http_addr\": admin, \"nodes\": [...]} JSON here once up")
    parser.add_argument("--log-dir", default=None,
                        help="keep the master's and node's logs in this folder (default: a "
                        "temporary folder, removed on exit unless a child failed)")


def _exit_report(child) -> str:
    """Which child stopped and how, with the tail of its log."""
    tail = child.log_tail(LOG_LINES).strip()
    lines = [f"kvpool serve: the {child.exit_message()}; stopping"]
    if tail:
        lines += [f"last lines of the {child.kind} log:"] + ["  " + line for line in tail.splitlines()]
    return "\n".join(lines)


def run(args) -> int:
    from kvpool.config import check_output_path, make_output_folder, write_ready_file
    from kvpool.launch import Cluster

    values = resolve(args, OPTIONS)
    size = segment_size(values["segment_size"])
    check_fits(size, prefault=True)
    check_output_path("--ready-file", args.ready_file)
    if args.log_dir:
        make_output_folder("--log-dir", args.log_dir)
    # a Ctrl-C (or SIGTERM) is recorded; the start's waits raise it (Cluster stops what
    # started), later the loop below ends the run
    with stop_on_signals(), Cluster(
            segment_size=size, lease_ttl_ms=values["default_kv_lease_ttl"], master_port=values["port"],
            host=values["host"], log_dir=args.log_dir,
            extra_master_args=() if values["http_port"] is None else ("--http-port", values["http_port"])) as cluster:
        check_stop()  # asked while the last child came up: nothing printed, nothing served
        print(f"kvpool master: {cluster.master_addr}", flush=True)
        if cluster.master.info.get("http_addr"):
            print(f"kvpool admin:  http://{cluster.master.info['http_addr']}/metrics", flush=True)
        for info in cluster.nodes:
            print(f"kvpool node:   {info['addr']} (segment {info['segment']}, {format_size(size)})", flush=True)
        print("Ctrl-C to stop.", flush=True)
        if args.ready_file:
            write_ready_file(args.ready_file, {"addr": cluster.master_addr,
                                               "http_addr": cluster.master.info.get("http_addr"),
                                               "nodes": cluster.node_addrs})
        while not wait_for_stop(0.5):
            dead = [c for c in cluster.children if c.proc.poll() is not None]
            if dead:
                print(_exit_report(dead[0]), flush=True)
                return 1
    return 0
