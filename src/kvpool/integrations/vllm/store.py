"""The connector's view of kvpool: a Client that may be absent, and its metrics.

vLLM must keep serving when kvpool's master is down or the store is full: every store
call goes through :class:`GuardedStore`, which turns a failure into "no result" (the
connector then reports no hit and saves nothing, so vLLM computes everything itself),
logs the outage once, and tries to reconnect after ``retry_s``, on a thread of its own:
a master that is stopped rather than gone accepts the connection and never answers, so
a reconnection made by the calling thread (vLLM's scheduler, in a lookup) stalled every
running request for ``timeout_s`` once per ``retry_s``. Calls come from vLLM's threads
and the connector's sender thread at once: a client that failed is closed when its last
call has returned, never under another thread's call. Counters live in
:data:`REGISTRY`, a Prometheus registry of this process (``metrics_port`` serves it).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import TypeVar

from prometheus_client import CollectorRegistry, Counter, start_http_server

from kvpool.client import Client
from kvpool.errors import KVPoolError

T = TypeVar("T")

REGISTRY = CollectorRegistry(auto_describe=True)
PREFIX = "kvpool_vllm_"
LABELS: dict[str, str] = {}  # the label of each labelled counter, by name without PREFIX


def counter(name: str, documentation: str, label: str | None = None) -> Counter:
    """Counter ``kvpool_vllm_<name>`` in :data:`REGISTRY`, with one label or none (recorded
    in :data:`LABELS`: vLLM's copies of the counters, ``stats``, are built from them)."""
    if label:
        LABELS[name] = label
    return Counter(PREFIX + name, documentation, [label] if label else [], registry=REGISTRY)


LOOKUP_BLOCKS = counter("lookup_blocks", "blocks looked up in kvpool beyond vLLM's local hit, "
                        "by result", "result")
BLOCKS_LOADED = counter("blocks_loaded", "blocks loaded from kvpool into vLLM")
BYTES_LOADED = counter("bytes_loaded", "bytes of stored pages loaded")
BLOCKS_SAVED = counter("blocks_saved", "blocks saved from vLLM into kvpool")
BYTES_SAVED = counter("bytes_saved", "bytes of stored pages saved")
SAVES_SKIPPED = counter("saves_skipped", "blocks not saved, by reason (exists, no_space, "
                        "unavailable, ...)", "reason")
LOAD_ERRORS = counter("load_errors", "blocks that failed to load and were recomputed, by reason "
                      "(missing, checksum, namespace, ...)", "reason")
FREES_DELAYED = counter("frees_delayed", "finished requests whose blocks vLLM kept until a save "
                        "of them in flight had ended")
UNAVAILABLE = counter("store_unavailable", "store calls that failed because kvpool could not "
                      "be reached")

_served_ports: set[int] = set()
_shared: dict[tuple[str, bool], "GuardedStore"] = {}
_shared_lock = threading.Lock()


def serve_metrics(port: int) -> None:
    """Serve :data:`REGISTRY` over HTTP on ``port`` (once per process and port)."""
    if port and port not in _served_ports:
        start_http_server(port, registry=REGISTRY)
        _served_ports.add(port)


def samples(registry: CollectorRegistry = REGISTRY, prefix: str = ""):
    """The samples of ``registry`` (default :data:`REGISTRY`) whose name starts with
    ``prefix``, counters' ``_created`` timestamps left out: each counter's value."""
    for family in registry.collect():
        for s in family.samples:
            if not s.name.endswith("_created") and s.name.startswith(prefix):
                yield s


def snapshot(registry: CollectorRegistry = REGISTRY, prefix: str = "") -> dict[str, float]:
    """:func:`samples` as ``{"name{label=value}": value}`` (for tests)."""
    out = {}
    for s in samples(registry, prefix):
        labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
        out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


class GuardedStore:
    """A lazily connected :class:`~kvpool.client.Client` whose failures are not vLLM's.

    Args:
        master: "host:port" of kvpool's master.
        force_tcp, timeout_s: as for Client.
        log: a logging.Logger (vLLM's), told once per outage and once on recovery.
        retry_s: seconds between reconnection attempts while kvpool is unreachable.
        clock: monotonic clock in seconds (injected by tests).
    """

    def __init__(self, master: str, force_tcp: bool, timeout_s: float, log, retry_s: float = 30.0,
                 clock: Callable[[], float] = time.monotonic):
        self.master, self.force_tcp, self.timeout_s = master, force_tcp, timeout_s
        self.log, self.retry_s, self.clock = log, retry_s, clock
        self._client: Client | None = None
        self._calls: collections.Counter[Client] = collections.Counter()  # calls running
        self._down_since: float | None = None
        self._next_try = 0.0
        self._reconnecting: threading.Thread | None = None  # while an attempt runs
        self._closes = 0  # close() calls: a reconnection begun before one is discarded
        self._lock = threading.Lock()

    @classmethod
    def shared(cls, master: str, force_tcp: bool, timeout_s: float, log,
               retry_s: float = 30.0) -> "GuardedStore":
        """One store per setting (master, force_tcp, timeout_s, retry_s) in a process, so
        that the scheduler and worker connectors of an in-process engine share a client
        and say an outage once (a connector of other timeouts gets its own: a trial saw
        one configured with 5 s run on another's)."""
        key = (master, force_tcp, timeout_s, retry_s)
        with _shared_lock:
            if key not in _shared:
                _shared[key] = cls(master, force_tcp, timeout_s, log, retry_s)
            return _shared[key]

    @property
    def down(self) -> bool:
        """True while kvpool is known unreachable: from a failure until a reconnection
        has succeeded (the scheduler plans no saves meanwhile). Asking starts a
        reconnection when one is due: a producer that only saves asks nothing else."""
        with self._lock:
            if self._client is None and self._down_since is not None:
                self._reconnect_if_due()
                return True
            return False

    def call(self, what: str, fn: Callable[[Client], T]) -> T | None:
        """``fn(client)``, or None when kvpool cannot be reached now (logged once)."""
        client = self._acquire()
        if client is None:
            UNAVAILABLE.inc()
            return None
        try:
            return fn(client)
        except (KVPoolError, OSError) as exc:
            self._fail(what, exc, client)
            UNAVAILABLE.inc()
            return None
        finally:
            self._release(client)

    def _acquire(self) -> Client | None:
        """The client, counted as in use; None while down. The first connection is made
        here (a new engine's first lookup waits for it); a reconnection after an outage
        is started on a thread when due, and this call returns None meanwhile."""
        with self._lock:
            if self._client is None:
                if self._down_since is None:
                    self._connect()
                else:
                    self._reconnect_if_due()
                if self._client is None:
                    return None
            self._calls[self._client] += 1
            return self._client

    def _reconnect_if_due(self) -> None:
        """Start a reconnection attempt on a thread when ``retry_s`` has passed and none
        runs (the caller holds the lock)."""
        if self.clock() >= self._next_try and self._reconnecting is None:
            self._reconnecting = threading.Thread(target=self._reconnect, args=(self._closes,),
                                                  daemon=True, name="kvpool-vllm-reconnect")
            self._reconnecting.start()

    def _connect(self) -> None:
        """Make the client (the caller holds the lock); on failure, mark kvpool down."""
        try:
            self._client = Client(self.master, force_tcp=self.force_tcp, timeout_s=self.timeout_s)
        except (KVPoolError, OSError) as exc:
            self._mark_down("connect", exc)

    def _reconnect(self, closes: int) -> None:
        """One reconnection attempt, off the callers' threads; the client is published
        only once it has answered, and only if the store was not closed meanwhile."""
        try:
            client = Client(self.master, force_tcp=self.force_tcp, timeout_s=self.timeout_s)
        except Exception as exc:  # noqa: BLE001 - any failure must leave a later retry possible
            with self._lock:
                self._reconnecting = None
                self._mark_down("connect", exc)
            return
        with self._lock:
            self._reconnecting = None
            closed = self._closes != closes
            if not closed:
                self._client, self._down_since = client, None
        if closed:
            client.close()
            return
        self.log.info("kvpool: master %s is reachable again; loading and saving KV blocks "
                      "resumes", self.master)

    def wait_reconnected(self, timeout_s: float) -> bool:
        """Wait for a reconnection attempt in flight (tests); True if none is left running."""
        thread = self._reconnecting
        if thread is not None:
            thread.join(timeout_s)
            return not thread.is_alive()
        return True

    def _release(self, client: Client) -> None:
        """One call of ``client`` fewer; a retired client is closed after its last call."""
        with self._lock:
            self._calls[client] -= 1
            if self._calls[client] > 0:
                return
            del self._calls[client]
            retired = client is not self._client
        if retired:
            client.close()

    def _fail(self, what: str, exc: Exception, client: Client) -> None:
        with self._lock:
            if self._client is client:
                self._client = None  # retired: closed by its last call's _release
            if self._client is None:  # not when a reconnection has already replaced it
                self._mark_down(what, exc)

    def _mark_down(self, what: str, exc: Exception) -> None:
        if self._down_since is None:
            self._down_since = self.clock()
            self.log.warning("kvpool: %s at master %s failed (%s); vLLM computes every token "
                             "itself until kvpool is back (retrying every %.0f s)",
                             what, self.master, exc, self.retry_s)
        self._next_try = self.clock() + self.retry_s

    def close(self) -> None:
        """Close the client (now, or after the calls still running on it); a
        reconnection still in flight closes what it makes. Not final: the store is
        shared by the scheduler and worker connectors of one process, and a later call
        by one of them connects again."""
        with self._lock:
            self._closes += 1
            client, self._client = self._client, None
            idle = client is not None and not self._calls[client]
        if idle:
            client.close()
