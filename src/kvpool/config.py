"""Settings helpers: human sizes ("16MB", "1GiB"), durations, addresses (``host:port``,
``[v6]:port``) and ``KVPOOL_*`` env vars."""

from __future__ import annotations

import difflib
import functools
import ipaddress
import json
import math
import os
import re
import tempfile
from fractions import Fraction

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


def parse_bool(text) -> bool:
    """A yes/no setting: a bool, or text 1/0, true/false, yes/no, on/off (any case).
    Raises ValueError otherwise ("expected yes or no"): ``bool("false")`` is True, so
    text from a config file or JSON is never taken by truthiness."""
    if isinstance(text, bool):
        return text
    value = str(text).strip().lower()
    if value not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        raise ValueError("expected yes or no")
    return value in ("1", "true", "yes", "on")


def positive(parse, zero_ok: bool = False):
    """An option parser: ``parse``, refusing NaN and infinity (a TTL of NaN started a
    master that then failed every MountSegment), values below 0, and 0 itself unless
    ``zero_ok``. Raises ValueError, which :func:`resolve` reports naming the option."""
    def check(text):
        value = parse(text)
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        if value < 0 or (value == 0 and not zero_ok):
            raise ValueError("must be >= 0" if zero_ok else "must be > 0")
        return value
    return check


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
        raise UserError(f"not a size: {value!r} (units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; "
                        "examples: 4096, 64MiB, 1GiB, 16MB)")
    return int(_number(m.group(1)) * _UNITS[unit])


def format_size(size: int) -> str:
    """Bytes (> 0) as the largest binary unit that divides them, the inverse of
    :func:`parse_size`: 1073741824 -> "1GiB", 3072 -> "3KiB", 1536 -> "1536 bytes"."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size} bytes"


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
    return int(_number(m.group(1)) * mult)


def _number(digits: str) -> Fraction:
    """``digits`` ("12", "1.5") exactly: a float turned 400 digits into inf (OverflowError).
    Raises UserError past Python's 4,300-digit limit on reading integers."""
    try:
        return Fraction(digits)
    except ValueError:
        raise UserError(f"not a size: {len(digits)} digits") from None


def env(name: str, default: str | None = None) -> str | None:
    """Read ``KVPOOL_<NAME>`` from the environment (name given without the prefix)."""
    return os.environ.get("KVPOOL_" + name.upper().replace("-", "_"), default)


def parse_addr(addr: str, default_port: int | None = None) -> tuple[str, int]:
    """Split an address into ``(host, port)`` (K24); the host comes without brackets.

    Forms: ``host:port`` (a name or IPv4), ``[v6]:port``, and with ``default_port`` also
    a bare host, ``[v6]`` or a bare IPv6 address (``::1``: a bare IPv6 never has a port;
    write ``[::1]:50051``). An empty host means 127.0.0.1 (``:50051``).
    Raises: UserError naming the address when it is malformed, the port is missing (and
    no default) or not 0..65535.
    """
    text = str(addr).strip()
    if text.startswith("["):
        host, close, rest = text[1:].partition("]")
        if not close or not _is_ipv6(host) or (rest and not rest.startswith(":")):
            raise UserError(f"bad address {addr!r}: write an IPv6 address as [v6]:port, e.g. [::1]:50051")
        port = rest[1:] if rest else None
    elif text.count(":") > 1:
        if not _is_ipv6(text):
            raise UserError(f"bad address {addr!r}: neither host:port nor an IPv6 address ([v6]:port)")
        host, port = text, None
    else:
        host, sep, port = text.partition(":")
        port = port or None  # "host:" is a host without a port
        if host and not _HOST_RE.match(host):
            raise UserError(f"bad host {host!r} in address {addr!r}")
    if port is None:
        if default_port is None:
            raise UserError(f"address {addr!r} needs a port, as host:port or [v6]:port")
        return host or "127.0.0.1", default_port
    if not (port.isascii() and port.isdigit()) or not 0 <= int(port) <= 65535:
        raise UserError(f"bad port in address {addr!r}")
    return host or "127.0.0.1", int(port)


def parse_host(text: str) -> str:
    """A host to bind or connect to, without a port: a name, IPv4, IPv6 (bare or in
    brackets; returned bare). Raises UserError when malformed or when it carries a port."""
    value = str(text).strip()
    host, port = parse_addr(value, default_port=-1)
    if port != -1 or not value:
        raise UserError(f"bad host {text!r}: give a host name or address without a port")
    return host


def format_addr(host: str, port: int) -> str:
    """``host:port``, with an IPv6 host in brackets (``[::1]:50051``): what
    :func:`parse_addr` reads back."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


_HOST_RE = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")  # names (RFC 1123, "_" too) and IPv4


def _is_ipv6(host: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(host), ipaddress.IPv6Address)
    except ValueError:
        return False


def parse_port(value: str | int) -> int:
    """A TCP port number: ``0..65535`` (0 = the OS picks a free port).

    Raises: UserError on anything else (the OS would silently take 70000 as 4464);
    :func:`resolve` adds the option's name and the value to the message.
    """
    text = str(value).strip()
    if isinstance(value, bool) or not (text.isascii() and text.isdigit()) or int(text) > 65535:
        raise UserError("a port is a whole number from 0 to 65535 (0 = any free port)")
    return int(text)


def _is_port(name: str) -> bool:
    return name == "port" or name.endswith("-port")


class Option:
    """One setting with the precedence flags > ``KVPOOL_<NAME>`` env > config file > default.

    name: the flag without dashes, e.g. "client-ttl" (file key "client_ttl" or
    "client-ttl"); parse: turns text from the env/file into the value (int, float,
    parse_size, str...); help: one line, to which the default and env var are appended.
    An option named ``port`` or ``*-port`` always parses with :func:`parse_port`, so
    every port flag of every subcommand is checked against 0..65535.
    """

    def __init__(self, name: str, default, parse=str, help: str = "", env: str | None = None,
                 metavar: str | None = None):
        parse = parse_port if _is_port(name) else parse
        self.name, self.default, self.parse, self.help = name, default, parse, help
        self._env = env  # override of the env var suffix, e.g. "MASTER_PORT"
        # what --help shows for the value: the flag's last word ("--client-ttl TTL") unless given
        self.metavar = metavar or self.dest.split("_")[-1].upper()

    @property
    def dest(self) -> str:
        return self.name.replace("-", "_")

    @property
    def env_name(self) -> str:
        return "KVPOOL_" + (self._env or self.dest.upper())


def add_options(parser, options: list[Option]) -> None:
    """Add ``--config`` and one flag per option; defaults resolve later in :func:`resolve`."""
    parser.add_argument(
        "--config", metavar="FILE", default=None,
        help="YAML or JSON file of settings (keys as flag names); "
        "precedence: flags > KVPOOL_* env vars > this file > defaults",
    )
    for opt in options:
        parser.add_argument(
            f"--{opt.name}", dest=opt.dest, default=None, metavar=opt.metavar,
            help=f"{opt.help} (default: {opt.default}; env {opt.env_name})",
        )


def load_config_file(path: str | None) -> dict:
    """Settings from a YAML or JSON file; {} when ``path`` is None.

    A ``.json`` file, or text whose first non-blank character is ``{``, is parsed as
    JSON (by :mod:`json`): YAML's flow syntax would accept some broken JSON, e.g. an
    unquoted key, and read it as something else.

    Raises: UserError when the file is missing, unreadable, not UTF-8, invalid JSON or
    YAML, not a mapping, or sets a key twice (verbatim, which both parsers would read
    as the last value, or as ``segment-size`` and ``segment_size``).
    """
    if not path:
        return {}
    import yaml

    try:
        with open(path, encoding="utf-8-sig") as f:  # -sig: a byte order mark is no setting
            text = f.read()
    except OSError as exc:
        raise UserError(f"cannot read config file {path!r}: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"config file {path!r} is not UTF-8 text (byte {exc.start}: "
                        f"{exc.object[exc.start:exc.start + 1]!r}): is it the right file?") from None
    if path.lower().endswith(".json") or text.lstrip().startswith("{"):
        try:
            data = json.loads(text, object_pairs_hook=_unique_pairs) if text.strip() else {}
        except ValueError as exc:
            raise UserError(f"config file {path!r} is not valid JSON: {exc}") from None
    else:
        try:
            data = yaml.load(text, Loader=_unique_keys_loader()) or {}
        except yaml.YAMLError as exc:
            raise UserError(f"config file {path!r} is not valid YAML: {_yaml_problem(exc)}") from None
    if not isinstance(data, dict):
        raise UserError(f"config file {path!r} must hold a mapping of settings")
    out: dict = {}
    spelled: dict = {}  # dest -> the key as written
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest in out:  # "segment-size" and "segment_size": which one was meant?
            raise UserError(f"config file {path!r} sets {dest.replace('_', '-')!r} twice "
                            f"(as {spelled[dest]!r} and {key!r}); keep one")
        out[dest] = value
        spelled[dest] = key
    return out


def resolve(args, options: list[Option]) -> dict:
    """Value of every option by precedence flags > env > ``args.config`` file > default.

    Returns: {dest: parsed value}. Raises: UserError naming the option on a bad value,
    or naming the key and the known keys when the config file has a key no option
    reads (a typo would otherwise silently fall back to the default).
    """
    file = load_config_file(getattr(args, "config", None))
    _check_file_keys(file, options, getattr(args, "config", None))
    out = {}
    for opt in options:
        for source, raw in (("flag", getattr(args, opt.dest, None)),
                            ("env", os.environ.get(opt.env_name)),
                            ("config file", file.get(opt.dest))):
            if raw is not None:
                try:
                    out[opt.dest] = opt.parse(raw)
                except (ValueError, TypeError, UserError) as exc:
                    shown = repr(raw) if len(repr(raw)) <= 80 else repr(raw)[:60] + f"... ({len(str(raw))} chars)"
                    raise UserError(f"bad value {shown} for {opt.name} (from {source}): {exc}") from None
                break
        else:
            out[opt.dest] = opt.default
    return out


def _check_file_keys(file: dict, options: list[Option], path: str | None) -> None:
    known = {opt.dest: opt.name for opt in options}
    unknown = [key for key in file if key not in known]
    if not unknown:
        return
    key = unknown[0].replace("_", "-")
    close = difflib.get_close_matches(key, known.values(), n=1)
    hint = f"; did you mean {close[0]!r}?" if close else ""
    raise UserError(f"config file {path!r}: unknown setting {key!r}{hint} "
                    f"(known: {', '.join(sorted(known.values()))})")


def write_ready_file(path: str, info: dict) -> None:
    """Write ``info`` as JSON to ``path`` atomically (rename), for launchers to poll."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(info, f)
    os.replace(tmp, path)


def check_at_least(args, minimum, *dests: str) -> None:
    """Refuse, naming the one flag, the first of ``args.<dest>`` below ``minimum``.

    ``dests`` are argparse destinations ("page_size" for ``--page-size``); an attribute
    that is None (not given, no default) is skipped. Raises: UserError.
    """
    for dest in dests:
        value = getattr(args, dest, None)
        if value is not None and value < minimum:
            raise UserError(f"--{dest.replace('_', '-')} must be >= {minimum}, got {value}")


def check_output_path(flag: str, path: str | None, make_folders: bool = False) -> None:
    """Refuse at start an output file that could only fail to be written at the end:
    its folder missing (or, with ``make_folders``, its nearest existing ancestor, since
    the writer creates the rest), not a folder, or not writable. None (not asked) passes.
    Raises: UserError naming ``flag``."""
    if not path:
        return
    folder = os.path.dirname(os.path.abspath(path))
    while make_folders and not os.path.exists(folder) and folder != os.path.dirname(folder):
        folder = os.path.dirname(folder)
    if os.path.exists(folder) and not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: {folder} is not a folder")
    if not os.path.isdir(folder):
        raise UserError(f"{flag} {path}: folder {folder} does not exist")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UserError(f"{flag} {path}: folder {folder} is not writable")
    if os.path.isdir(path):
        raise UserError(f"{flag} {path}: is a folder, not a file")


def make_output_folder(flag: str, path: str) -> str:
    """Make the folder ``path`` (and its parents) for a command's logs, now rather than
    once children start. Returns ``path``. Raises: UserError naming ``flag`` when it
    cannot be made (a file in the way, no permission, a read-only file system) or a file
    cannot be made in it (tried: ``os.access`` says yes to root for a folder such as
    /sys/kernel, and the first log then failed with a traceback)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"{flag} {path}: cannot make the folder: {exc.strerror or exc}") from None
    try:
        tempfile.TemporaryFile(dir=path).close()
    except OSError as exc:
        raise UserError(f"{flag} {path}: folder is not writable ({exc.strerror or exc})") from None
    return path


def _unique_pairs(pairs: list[tuple[str, object]]) -> dict:
    """A JSON object as a dict; raises ValueError for a key it holds twice."""
    out: dict = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"key {key!r} is set twice; keep one")
        out[key] = value
    return out


@functools.cache
def _unique_keys_loader():
    """PyYAML's SafeLoader, refusing a mapping that holds a string key written twice in
    it (it keeps the last one silently; YAML 1.2 says keys are unique)."""
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            seen = set()
            span = range(node.start_mark.index, node.end_mark.index)
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge" or key_node.start_mark.index not in span:
                    continue  # a merge ("<<:"), or a key it brought in: keys written here override it
                key = self.construct_object(key_node, deep=True)
                if not isinstance(key, str):
                    continue  # settings are named by strings; others are refused as unknown
                if key in seen:
                    raise yaml.constructor.ConstructorError(
                        "while reading a mapping", node.start_mark,
                        f"key {key!r} is set twice; keep one", key_node.start_mark)
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def _yaml_problem(exc) -> str:
    """One line of a YAML parser's error: what it was parsing and where, what it
    expected and where (PyYAML's own text spans several lines, with source lines and
    carets)."""
    problem = getattr(exc, "problem", None)
    if not problem:
        return " ".join(str(exc).split())
    parts = [(getattr(exc, "context", None), getattr(exc, "context_mark", None)),
             (problem, getattr(exc, "problem_mark", None))]
    return ": ".join(f"{text}{_at(mark)}" for text, mark in parts if text)


def _at(mark) -> str:
    """`` (line L, column C)`` of a PyYAML mark (1-based), or nothing."""
    return "" if mark is None else f" (line {mark.line + 1}, column {mark.column + 1})"


def raise_open_files(n: int) -> int:
    """Raise this process's soft open-file limit (``RLIMIT_NOFILE``, inherited by its
    children) to ``n`` descriptors, or as near as the hard limit allows; returns the soft
    limit in force afterwards (below ``n`` when the hard limit is lower)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft >= n:
        return soft
    target = n if hard == resource.RLIM_INFINITY else min(n, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft
    return target
