"""The native kvpool store client (see :class:`kvpool.client.client.Client`)."""

from kvpool.client.client import Client, ReadHandle, check_key

__all__ = ["Client", "ReadHandle", "check_key"]
