"""The native kvpool store client (see :class:`kvpool.client.client.Client`)."""

from kvpool.client.client import Client
from kvpool.client.grants import ReadHandle
from kvpool.client.keys import check_key

__all__ = ["Client", "ReadHandle", "check_key"]
