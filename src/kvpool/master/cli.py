"""``kvpool master``: run the metadata service (Mooncake's mooncake_master flags)."""

from __future__ import annotations

import asyncio
import errno
import gc
import logging
import os
import signal
import sys

from kvpool.auth import secret_bytes
from kvpool.config import (
    Option, add_options, check_output_path, format_addr, parse_addr, parse_host, parse_size, positive, resolve,
    write_ready_file,
)
from kvpool.errors import UserError
from kvpool.master.config import MasterConfig
from kvpool.master.segments import STRATEGIES
from kvpool.masters import DEFAULT_KEY, DEFAULT_MASTER_PORT
from kvpool.spin import BUSY_POLL_US

HELP = "run the kvpool master (metadata, leases, allocation, eviction)"


def _ratio(text) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise ValueError("must be between 0 and 1")
    return value


def _strategy(text) -> str:
    if text not in STRATEGIES:
        raise ValueError(f"choose one of {', '.join(STRATEGIES)}")
    return text


OPTIONS = [
    Option("host", "127.0.0.1", parse_host, "address to listen on: a name, IPv4 or IPv6 (::1)", env="MASTER_HOST"),
    Option("port", DEFAULT_MASTER_PORT, int, "TCP port of the control plane (0 = any free port)", env="MASTER_PORT"),
    Option("default-kv-lease-ttl", 10_000, positive(int), "read lease granted by get/exist, ms"),
    Option("eviction-high-watermark-ratio", 0.90, _ratio, "evict when used/total exceeds this"),
    Option("eviction-ratio", 0.05, _ratio, "share of objects one eviction pass frees"),
    Option("client-ttl", 10.0, positive(float), "seconds without heartbeat before a node's segments are unmounted"),
    Option("put-start-discard-timeout", 30.0, positive(float), "seconds after which an unfinished put may be taken over"),
    Option("put-start-release-timeout", 600.0, positive(float), "seconds after which an unfinished put's space is freed"),
    Option("soft-pin-ttl", 1_800_000, positive(int), "how long a soft pin protects an object, ms"),
    Option("max-soft-pin-ttl", 86_400_000, positive(int), "largest soft-pin TTL a put may ask for, ms"),
    Option("allocation-strategy", "random", _strategy, f"replica placement: {' | '.join(STRATEGIES)}"),
    Option("alloc-lease-ttl", 10.0, positive(float), "seconds a client may allocate from and commit "
           "into an allocation lease (one-round-trip puts)"),
    Option("alloc-lease-size", 64 << 20, parse_size, "largest allocation lease, bytes (also at most "
           "1/16 of its segment; 0 = no leases: every put takes PutStart and PutEnd)"),
    Option("max-leases-per-owner", 4, positive(int), "open allocation leases one client may hold",
           metavar="N"),
    Option("http-port", None, int, "admin HTTP port: /health /metrics /segments /query_key /keys "
           "(0 = a free port; unset = no admin server)", env="MASTER_HTTP_PORT"),
    Option("secret", "", str, "shared secret every client, node and admin request must prove "
           "(empty = none; prefer the env var or a config file: flags show in ps)", env="SECRET"),
    Option("frame-timeout", 30.0, positive(float), "seconds a request frame may take to arrive after "
           "its header before the connection is closed"),
    Option("busy-poll", BUSY_POLL_US, positive(int, zero_ok=True), "microseconds the master keeps polling for the next "
           "request after answering one, while requests come that quickly (0 = never: sleep at once; "
           "polling saves waking a sleeping core, 30-40 us per request on a VM)"),
    Option("etcd", "", str, "etcd endpoints host:port[,host:port...]: run as leader or standby of an HA "
           "group (leader election on an etcd lease; empty = a single master)", env="ETCD"),
    Option("etcd-key", DEFAULT_KEY, str, "the election key in etcd (one per HA group)"),
    Option("etcd-lease-ttl", 5, positive(int), "seconds of the leader's etcd lease: a standby takes over "
           "within about this long after the leader dies"),
    Option("advertise", "", str, "host:port clients and nodes reach this master at, published in etcd "
           "while it leads (default: the address it listens on)"),
]
LOST_LEAD = 3  # exit status of a master that lost the lead (its supervisor restarts it)


def add_arguments(parser) -> None:
    add_options(parser, OPTIONS)
    parser.add_argument("--ready-file", default=None, help="write {\"addr\": ...} JSON here once serving")


def config_from(values: dict) -> MasterConfig:
    """MasterConfig from resolved option values."""
    return MasterConfig(
        default_kv_lease_ttl_ms=values["default_kv_lease_ttl"],
        eviction_high_watermark_ratio=values["eviction_high_watermark_ratio"],
        eviction_ratio=values["eviction_ratio"],
        client_ttl_s=values["client_ttl"],
        put_start_discard_timeout_s=values["put_start_discard_timeout"],
        put_start_release_timeout_s=values["put_start_release_timeout"],
        soft_pin_ttl_ms=values["soft_pin_ttl"],
        max_soft_pin_ttl_ms=values["max_soft_pin_ttl"],
        allocation_strategy=values["allocation_strategy"],
        alloc_lease_ttl_s=values["alloc_lease_ttl"],
        alloc_lease_size=values["alloc_lease_size"],
        max_leases_per_owner=values["max_leases_per_owner"],
    )


async def serve(service, host: str, port: int, ready_file: str | None,
                http_port: int | None = None, stall_s: float = 30.0, secret: bytes | None = None,
                ha: dict | None = None, busy_poll_us: int = BUSY_POLL_US) -> bool:
    """Assemble and run the master process until SIGTERM/SIGINT: the control-plane server
    over ``service`` (a :class:`~kvpool.master.service.MasterService`), its upkeep tick,
    and with ``http_port`` the admin HTTP app (:mod:`kvpool.master.admin`) on the same
    loop (0 = a free port, None = none); ``stall_s``: the frame timeout; ``secret``:
    what connections and admin requests must prove (:mod:`kvpool.auth`); ``ha``: the
    resolved ``etcd*``/``advertise`` options (None: a single master; else it serves
    only while it leads, :mod:`kvpool.master.election`); ``busy_poll_us``: the longest
    busy poll after an answer (:mod:`kvpool.master.busy_poll`). Returns False when it stopped
    because it lost the lead. Raises OSError if the port cannot be bound."""
    from kvpool.master.admin import start_master_admin
    from kvpool.master.server import MasterServer

    # millions of long-lived metadata objects make each full GC pass costly: collect
    # young objects less often (measured: 34 -> 25 us per put at 100k objects)
    gc.set_threshold(50_000, 20, 100)
    server = MasterServer(service, host, port, stall_s, secret, busy_poll_s=busy_poll_us / 1e6)
    if ha:  # refuse from the first connection on, until elected
        server.gate = lambda: "standby master (not elected yet)"
    addr = await server.start()
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    election = _election(ha, addr, server, lambda: loop.call_soon_threadsafe(stop.set)) if ha else None
    http_addr = None
    if http_port is not None:
        _, http_addr = await start_master_admin(server, host, http_port)
        print(f"kvpool master admin HTTP on {http_addr}", flush=True)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    ticker = asyncio.create_task(server.tick_forever())
    print(f"kvpool master listening on {addr}" + (" (standby until elected)" if election else ""), flush=True)
    if ready_file:
        write_ready_file(ready_file, {"addr": addr, "pid": os.getpid(), "http_addr": http_addr,
                                      "ha": election is not None})
    if election is not None:
        election.start()
    await stop.wait()
    ticker.cancel()
    await server.close()
    if election is None:
        return True
    lost = election.led and not election.leading()
    election.stop()
    return not lost


def _election(ha: dict, addr: str, server, lost):
    """The Election of this master, gating ``server``; ``lost()`` stops the process."""
    from kvpool.etcd import Etcd
    from kvpool.master.election import Election

    election = Election(Etcd(ha["etcd"]), ha["advertise"] or addr, ha["etcd_lease_ttl"], ha["etcd_key"],
                        on_elected=lambda: print(f"kvpool master {addr} is the leader", flush=True),
                        on_lost=lost)
    server.gate = election.refusal
    return election


def run(args) -> int:
    from kvpool.master.server import run_event_loop
    from kvpool.master.service import MasterService

    values = resolve(args, OPTIONS)
    if values["soft_pin_ttl"] > values["max_soft_pin_ttl"]:
        raise UserError("--soft-pin-ttl must not exceed --max-soft-pin-ttl")
    check_output_path("--ready-file", args.ready_file)  # else "cannot listen" once serving
    logging.basicConfig(level=logging.INFO, format="%(asctime)s master %(levelname)s %(message)s")
    service = MasterService(config_from(values))
    ha = ({k: values[k] for k in ("etcd", "etcd_key", "etcd_lease_ttl", "advertise")}
          if values["etcd"] else None)
    if ha and ha["advertise"]:
        ha["advertise"] = format_addr(*parse_addr(ha["advertise"]))
    elif ha and values["host"] in ("0.0.0.0", "::"):
        raise UserError(f"--etcd with --host {values['host']}: give --advertise host:port, the address "
                        "clients and nodes reach this master at (it is published in etcd)")
    try:
        kept = run_event_loop(serve(service, values["host"], values["port"], args.ready_file,
                                    values["http_port"], values["frame_timeout"],
                                    secret_bytes(values["secret"]), ha, values["busy_poll"]))
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise UserError(f"port {values['port']} on {values['host']} is already in use") from None
        raise UserError(f"cannot listen on {format_addr(values['host'], values['port'])}: {exc.strerror}") from None
    if kept is False:
        print("kvpool master: lost the lead (etcd lease ran out) and stopped; start it again as a standby",
              file=sys.stderr, flush=True)
        return LOST_LEAD
    return 0
