"""Arguments of ``MooncakeDistributedStore.setup``: the positional form and the dict form.

Mooncake accepts ``setup(local_hostname, metadata_server, global_segment_size,
local_buffer_size, protocol, rdma_devices, master_server_addr, ...)`` and
``setup({"local_hostname": ..., "global_segment_size": "16MB", ...})``; in the dict form
every value is text and sizes use binary units ("16MB" = 16 MiB). Both become one
:class:`SetupArgs`, checked the way Mooncake's RealClient checks them (sizes 0 or
1 KiB .. 1 TiB), plus kvpool's own limits (features it does not have are refused).
:func:`identity` then gives the set-up store its "host:port" (K08).
"""

from __future__ import annotations

import logging
import socket
from dataclasses import dataclass

from kvpool.client import Client
from kvpool.config import format_addr, parse_addr, parse_size_mooncake
from kvpool.errors import InvalidParams, UserError
from kvpool.masters import DEFAULT_MASTER_PORT
from kvpool.node.segment_host import bind_listener

log = logging.getLogger("kvpool.mooncake")

MIN_SEGMENT_SIZE = 1 << 10  # Mooncake's MIN_SEGMENT_SIZE
MAX_SEGMENT_SIZE = 1 << 40  # Mooncake's MAX_SEGMENT_SIZE
DEFAULT_SEGMENT_SIZE = 16 << 20  # Mooncake's DEFAULT_GLOBAL_SEGMENT_SIZE
DEFAULT_LOCAL_BUFFER_SIZE = 16 << 20
DEFAULT_MASTER = f"127.0.0.1:{DEFAULT_MASTER_PORT}"
PROTOCOLS = ("tcp", "rdma")  # both map to kvpool's transports (shm same host, else TCP)
_TRUE = ("1", "true", "yes", "on")


@dataclass
class SetupArgs:
    """Validated setup values. ``host``/``port``: local_hostname split (port 0 when it
    names none); ``bind_host``: the address this store's sockets bind."""

    local_hostname: str
    host: str
    port: int
    master_server_addr: str
    global_segment_size: int
    local_buffer_size: int
    protocol: str

    @property
    def bind_host(self) -> str:
        return "127.0.0.1" if self.host == "localhost" else self.host


def _size(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidParams(f"{name} must be an int or a size like '16MB', got {value!r}")
    try:
        size = parse_size_mooncake(value)
    except UserError as exc:
        raise InvalidParams(f"{name}: {exc}") from None
    if size != 0 and not MIN_SEGMENT_SIZE <= size <= MAX_SEGMENT_SIZE:
        raise InvalidParams(f"{name} must be 0 or between 1 KiB and 1 TiB, got {size}")
    return size


def _flag(value) -> bool:
    return value is True or str(value).strip().lower() in _TRUE


def build(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
          master_server_addr, unsupported: dict) -> SetupArgs:
    """Check one setup call's values. ``unsupported``: {option: value} of Mooncake
    features kvpool lacks; any that is set raises.

    Raises InvalidParams (the facade returns -600) with the reason.
    """
    if not isinstance(local_hostname, str) or not local_hostname:
        raise InvalidParams("local_hostname is required")
    if not isinstance(metadata_server, str) or not metadata_server:
        raise InvalidParams("metadata_server is required (kvpool ignores its value)")
    if protocol not in PROTOCOLS:
        raise InvalidParams(f"protocol must be one of {PROTOCOLS}, got {protocol!r}")
    for option, value in unsupported.items():
        if value not in (None, False, "") and (not isinstance(value, str) or _flag(value)):
            raise InvalidParams(f"{option} is not supported by kvpool")
    try:
        host, port = parse_addr(master_server_addr)
        own_host, own_port = parse_addr(local_hostname, default_port=0)
    except UserError as exc:
        raise InvalidParams(f"master_server_addr or local_hostname: {exc}") from None
    return SetupArgs(local_hostname, own_host, own_port, format_addr(host, port),
                     _size("global_segment_size", global_segment_size),
                     _size("local_buffer_size", local_buffer_size), protocol)


def from_dict(config: dict) -> SetupArgs:
    """SetupArgs from Mooncake's dict form (values may be text). Unknown keys are
    ignored, as Mooncake does. Raises InvalidParams."""
    get = config.get
    return build(
        str(get("local_hostname", "")), str(get("metadata_server", "")),
        get("global_segment_size", DEFAULT_SEGMENT_SIZE), get("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE),
        str(get("protocol", "tcp")), str(get("master_server_addr", DEFAULT_MASTER)),
        {"enable_ssd_offload": get("enable_ssd_offload"),
         "enable_client_http_server": get("enable_client_http_server")},
    )


def identity(args: SetupArgs, client: Client) -> tuple[str, socket.socket | None]:
    """(get_hostname()'s "host:port", the socket holding its port or None). A store with
    a segment is identified by its data server's port; a pure client reserves the port
    local_hostname names (port 0: one the OS picks), so two stores on one host never
    share an identity (K08). Raises UserError when that port is taken."""
    if client.segment is not None:
        port = parse_addr(client.segment.data_addr)[1]
        if args.port not in (0, port):
            log.warning("local_hostname %s: the segment's data server listens on port %d instead "
                        "(get_hostname() reports it)", args.local_hostname, port)
        return format_addr(args.host, port), None
    sock = bind_listener(args.bind_host, args.port)  # held, never served: it only reserves the port
    return format_addr(args.host, sock.getsockname()[1]), sock


def release(client: Client, reservation: socket.socket | None) -> None:
    """Close ``client`` (its segment is unmounted) and free the reserved port."""
    client.close()
    if reservation is not None:
        reservation.close()
