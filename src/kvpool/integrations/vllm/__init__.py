"""kvpool as vLLM's KV connector: ``kv_connector_module_path: "kvpool.integrations.vllm"``,
``kv_connector: "KVPoolConnector"`` (see :mod:`kvpool.integrations.vllm.connector`).

``KVPoolConnector`` is imported on first use, so that the vLLM-free parts (``layout``)
import without vLLM installed.
"""


def __getattr__(name: str):
    if name == "KVPoolConnector":
        from kvpool.integrations.vllm.connector import KVPoolConnector

        return KVPoolConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
