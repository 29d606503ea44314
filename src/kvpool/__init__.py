"""kvpool: a distributed, tiered KV-cache store for LLM serving.

The public entry points are re-exported lazily so that `import kvpool` stays cheap
(no torch, no sockets) for processes such as the master that need none of them.
"""

__version__ = "0.1.0"

__all__ = ["Client", "ErrorCode", "KVPoolError", "__version__"]


def __getattr__(name):
    if name in ("ErrorCode", "KVPoolError"):
        from kvpool import errors

        return getattr(errors, name)
    if name == "Client":
        from kvpool.client import Client

        return Client
    raise AttributeError(f"module 'kvpool' has no attribute {name!r}")
