"""Admin HTTP endpoints of the master and the node (aiohttp), with Prometheus metrics.

- master (:mod:`kvpool.admin.master_app`): ``/health``, ``/metrics``, ``/segments``,
  ``/query_key?key=``, ``/keys?prefix=&limit=``; served on the master's own event loop,
  so handlers read the metadata without locks (one loop owns it).
- node (:mod:`kvpool.admin.node_app`): ``/health``, ``/metrics``; served from a thread of
  its own, because the node is thread-based.

Both start only when ``--http-port`` is given (0 = a free port); the bound address is
written into the process's ready file as ``"http_addr"``. Imports point down: this
package uses protocol/errors only and reads the master's state by duck typing, so the
master and node import it (lazily) and not the other way round.
"""
