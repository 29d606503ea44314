"""The systems ``kvpool bench store`` compares, one :class:`~kvpool.bench.harness.Target`
module each, every one run in a worker process of its own (:mod:`kvpool.bench.worker`):

- :mod:`~kvpool.bench.systems.kvpool`: kvpool's columns (in-process segment, same-host
  shared memory, TCP, TCP across a veth pair) and its memory probe;
- :mod:`~kvpool.bench.systems.mooncake`: Mooncake Store (in-process and cross-process);
- :mod:`~kvpool.bench.systems.redis`: redis-server with redis-py;
- :mod:`~kvpool.bench.systems.limits`: the machine's limits (memcpy, one TCP stream);
- :mod:`~kvpool.bench.systems.netns`: network namespaces the columns run in.
"""
