"""An engine's extra config for kvpool (vLLM's ``kv_connector_extra_config``, LMCache's
``extra_config``): JSON values read strictly, and keys kvpool does not know named.

JSON gives a flag as ``true`` or, from a shell or a YAML file, as the text ``"false"``,
which Python's ``bool()`` reads as True; and a misspelt key (``"mastr"``) would
otherwise fall back to its default without a word.
"""

from __future__ import annotations

import difflib
import logging

from kvpool.config import parse_bool
from kvpool.errors import UserError


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
