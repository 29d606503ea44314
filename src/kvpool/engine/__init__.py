"""Reference engine on HF transformers: model loading, prefix-KV reuse, the demo.

Public API (src/kvpool/README.md, "Contract: kvpool.engine"): ``Engine``,
``GenerateResult``, ``load_model``, ``LoadedModel``. They are imported on first use so
that ``kvpool demo``'s parent process and the CLI's help never import torch.
"""

__all__ = ["Engine", "GenerateResult", "LoadedModel", "load_model"]


def __getattr__(name):
    if name in ("Engine", "GenerateResult"):
        from kvpool.engine import engine

        return getattr(engine, name)
    if name in ("LoadedModel", "load_model"):
        from kvpool.engine import models

        return getattr(models, name)
    raise AttributeError(f"module 'kvpool.engine' has no attribute {name!r}")
