"""Adapters that let other serving engines (vLLM, SGLang, LMCache) use kvpool's store."""
