"""An engine's extra config for kvpool (vLLM's ``kv_connector_extra_config``, SGLang's
``--hicache-storage-backend-extra-config``, LMCache's ``extra_config``): JSON values
read strictly, and keys kvpool does not know named.

JSON gives a flag as ``true`` or, from a shell or a YAML file, as the text ``"false"``,
which Python's ``bool()`` reads as True; and a misspelt key (``"mastr"``) would
otherwise fall back to its default without a word. A value that cannot work (a
timeout of 0 or NaN, a master without a port) is refused when the engine starts,
naming the key: a trial found such mistakes accepted, then reported on every call as
a kvpool outage ("computing every token until kvpool is back"), forever.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging

from kvpool.config import parse_bool, positive
from kvpool.errors import UserError
from kvpool.masters import check_spec


def flag(extra: dict, key: str, default: bool) -> bool:
    """``extra[key]`` as a bool (:func:`kvpool.config.parse_bool`), ``default`` when
    absent or null. Raises UserError naming the key for any other value."""
    value = extra.get(key)
    if value is None:
        return default
    try:
        return parse_bool(value)
    except ValueError:
        raise UserError(f"{key} must be true or false, got {value!r}") from None


def warn_unknown(extra: dict, known: frozenset[str], log: logging.Logger, where: str) -> list[str]:
    """Log one warning naming the keys of ``extra`` not in ``known`` (with the closest
    known key, if any), as ``where`` ("kv_connector_extra_config"); returns them, sorted."""
    unknown = sorted(k for k in extra if k not in known)
    for key in unknown:
        close = difflib.get_close_matches(str(key), sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        log.warning("kvpool: %s key %r is not one kvpool reads: ignored%s", where, key, hint)
    return unknown


def number(extra: dict, key: str, default: float, *, zero_ok: bool = False) -> float:
    """``extra[key]`` as a finite number > 0 (>= 0 with ``zero_ok``), ``default`` when
    absent or null (a number, or a numeric text such as ``"2.5"``). Raises UserError
    naming the key for anything else."""
    value = extra.get(key)
    if value is None:
        return default
    try:
        if isinstance(value, bool):
            raise TypeError  # float(True) is 1.0: a flag, not a number
        out = float(value)
    except (TypeError, ValueError):
        raise UserError(f"{key} must be a number, got {value!r}") from None
    try:
        return positive(float, zero_ok)(out)  # the master's and node's option check
    except ValueError as exc:
        raise UserError(f"{key} {exc}, got {value!r}") from None


def whole(extra: dict, key: str, default: int, lowest: int = 1, highest: int | None = None) -> int:
    """``extra[key]`` as an int in ``lowest..highest``, ``default`` when absent or null.
    Raises UserError naming the key for anything else (2.5, "two", true)."""
    value = extra.get(key)
    if value is None:
        return default
    try:
        out = int(value) if not isinstance(value, (bool, float)) else None
    except (TypeError, ValueError):
        out = None
    if out is None or out < lowest or (highest is not None and out > highest):
        span = f"{lowest}..{highest}" if highest is not None else f">= {lowest}"
        raise UserError(f"{key} must be an integer {span}, got {value!r}")
    return out


def master(extra: dict, key: str, default: str | None = None) -> str:
    """``extra[key]``, a master spec (``host:port``, ``h1:p1,h2:p2``, ``etcd://...``),
    canonical; ``default`` when absent or empty. Raises UserError naming the key for a
    malformed one, and when there is neither."""
    value = extra.get(key) or default
    if not value:
        raise UserError(f'needs "{key}": "host:port" (the kvpool master)')
    try:
        return check_spec(str(value))
    except UserError as exc:
        raise UserError(f"{key}: {exc}") from None


@dataclasses.dataclass(frozen=True)
class PageStoreSettings:
    """What SGLang's and LMCache's backends read from their extra config: the master
    spec, force_tcp, timeout_s and retry_s (seconds), replica_num."""

    master: str
    force_tcp: bool
    timeout_s: float
    retry_s: float
    replica_num: int


def page_store_settings(extra: dict, prefix: str, where: str) -> PageStoreSettings:
    """:class:`PageStoreSettings` from the keys of ``extra`` named ``prefix`` + key
    (defaults: timeout_s 10, retry_s 10, replica_num 1, force_tcp false). Raises
    ValueError, as SGLang's and LMCache's factories expect, naming ``where`` and the key."""
    try:
        return PageStoreSettings(master(extra, f"{prefix}master"), flag(extra, f"{prefix}force_tcp", False),
                                 number(extra, f"{prefix}timeout_s", 10.0), number(extra, f"{prefix}retry_s", 10.0),
                                 whole(extra, f"{prefix}replica_num", 1))
    except UserError as exc:
        raise ValueError(f"{where}: {exc}") from None
