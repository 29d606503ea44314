"""Benchmarks: ``kvpool bench store`` (data path vs Mooncake, Redis and the machine's
limits: :mod:`~kvpool.bench.store`, the systems in :mod:`~kvpool.bench.systems`) and
``kvpool bench cache`` (the tiered prefix cache: :mod:`~kvpool.bench.cache` runs
:mod:`~kvpool.bench.trace_replay` or :mod:`~kvpool.bench.engine_sweep`)."""
