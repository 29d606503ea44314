"""Adapters that plug kvpool into serving engines' own extension points (SGLang HiCache,
LMCache, vLLM). Each module imports its engine's package; import only the one you use."""
