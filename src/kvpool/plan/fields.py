"""Typed reads of one ``config.json`` dict: a missing or malformed field is a
:class:`~kvpool.errors.UserError` that names the field and the file."""

from __future__ import annotations

from typing import Any

from kvpool.errors import UserError


class Fields:
    """Reads fields from one config dict (``source`` names it in errors)."""

    def __init__(self, cfg: dict[str, Any], source: str):
        self.cfg, self.source = cfg, source

    def has(self, name: str) -> bool:
        return self.cfg.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.cfg.get(name)
        return default if value is None else value

    def error(self, message: str) -> UserError:
        return UserError(f"{self.source}: {message}")

    def int(self, name: str, why: str, minimum: int = 1) -> int:
        if not self.has(name):
            raise self.error(f"missing field {name!r} (needed for {why})")
        value = self.cfg[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self.error(f"field {name!r} must be an integer >= {minimum}, got {value!r}")
        return value

    def first_int(self, names: tuple[str, ...], why: str, minimum: int = 1) -> int:
        """The first of ``names`` present (spellings of one field across model families)."""
        for name in names:
            if self.has(name):
                return self.int(name, why, minimum)
        also = f"; also accepted: {', '.join(names[1:])}" if len(names) > 1 else ""
        raise self.error(f"missing field {names[0]!r} (needed for {why}{also})")

    def int_list(self, name: str, n: int, base: int) -> list[int]:
        """A list of layer numbers counted from ``base`` (0 or 1), each in range for
        ``n`` layers; returned 0-based."""
        value = self.cfg.get(name)
        if not isinstance(value, list):
            raise self.error(f"field {name!r} must be a list of layer numbers, got {value!r}")
        for number in value:
            if isinstance(number, bool) or not isinstance(number, int) or not (
                    base <= number < n + base):
                raise self.error(f"field {name!r} has {number!r}; layer numbers are "
                                 f"{base}..{n - 1 + base}")
        return [number - base for number in value]
