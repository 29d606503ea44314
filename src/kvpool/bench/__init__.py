"""Benchmarks: ``kvpool bench store`` (data path vs Mooncake, Redis and the machine's
limits) and ``kvpool bench cache`` (the tiered prefix cache; its own module)."""
