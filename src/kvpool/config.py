"""Settings helpers: human sizes ("16MB", "1GiB"), durations and ``KVPOOL_*`` env vars."""

from __future__ import annotations

import os
import re

from kvpool.errors import UserError

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "kib": 1 << 10,
    "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
    "g": 1000**3, "gb": 1000**3, "gib": 1 << 30,
    "t": 1000**4, "tb": 1000**4, "tib": 1 << 40,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int) -> int:
    """Parse a byte size: an int, or text like ``"4096"``, ``"16MB"``, ``"1GiB"``.

    Decimal units (KB, MB, GB, TB) are powers of 1000 and binary units (KiB, MiB,
    GiB, TiB) powers of 1024, as in IEC 80000-13. Mooncake's ``setup`` treats
    "16MB" as 16 MiB, so :func:`parse_size_mooncake` exists for the facade.

    Returns: the size in bytes (int >= 0).
    Raises: UserError on text that is not a size.
    """
    if isinstance(value, int):
        if value < 0:
            raise UserError(f"size must be >= 0, got {value}")
        return value
    m = _SIZE_RE.match(str(value))
    unit = m.group(2).lower() if m else None
    if not m or unit not in _UNITS:
        raise UserError(f"not a size: {value!r} (examples: 4096, 64MiB, 1GiB, 16MB)")
    return int(float(m.group(1)) * _UNITS[unit])


def parse_size_mooncake(value: str | int) -> int:
    """Parse a size the way Mooncake's Python ``setup`` does: every unit is binary.

    "16MB" → 16 MiB. Returns bytes; raises UserError on text that is not a size.
    """
    if isinstance(value, int):
        return parse_size(value)
    m = _SIZE_RE.match(str(value))
    if not m:
        raise UserError(f"not a size: {value!r}")
    unit = m.group(2).lower().rstrip("ib").rstrip("b") if m.group(2) else ""
    mult = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(unit)
    if mult is None:
        raise UserError(f"not a size: {value!r}")
    return int(float(m.group(1)) * mult)


def env(name: str, default: str | None = None) -> str | None:
    """Read ``KVPOOL_<NAME>`` from the environment (name given without the prefix)."""
    return os.environ.get("KVPOOL_" + name.upper().replace("-", "_"), default)


def parse_addr(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """Split ``"host:port"`` into ``(host, port)``.

    Raises: UserError when the port is missing (and no default) or not 0..65535.
    """
    host, sep, port = str(addr).rpartition(":")
    if not sep:
        host, port = addr, ""
    if not port:
        if default_port is None:
            raise UserError(f"address {addr!r} needs a port, as host:port")
        return host or "127.0.0.1", default_port
    if not port.isdigit() or not 0 <= int(port) <= 65535:
        raise UserError(f"bad port in address {addr!r}")
    return host or "127.0.0.1", int(port)
