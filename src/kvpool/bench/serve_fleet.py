"""The vLLM servers of ``kvpool bench serve``: ``vllm serve`` (vLLM's own OpenAI server)
per instance, from vLLM's virtual environment, for one connector kind.

Kinds: ``plain`` (vLLM's local prefix cache only), ``example`` (vLLM's bundled
``ExampleConnector``: KV of whole prompts as safetensors files in a folder both
instances share), ``kvpool`` (``KVPoolConnector`` on the shared store; instance ``i``
saves to segment ``segments[i]`` first and serves its connector counters on a port of
its own). Every instance runs the same engine settings: fp32, block 32, eager mode (no
compilation at start-up), sha256_cbor
block hashes (reproducible in the router), one CPU core (``VLLM_CPU_OMP_THREADS_BIND``:
instance ``i`` on core ``i mod cores``), and reports cached prompt tokens in its usage
records. Start-up polls ``/health`` with a deadline; an instance that exits first
fails the start with its log's tail.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import kvpool
from kvpool.child import spawn
from kvpool.errors import UserError
from kvpool.ports import free_port

KINDS = ("plain", "example", "kvpool")
BLOCK_SIZE = 32
HASH_ALGO = "sha256_cbor"


def vllm_python(given: str | None) -> Path:
    """vLLM's interpreter: ``given``, else ``$KVPOOL_VLLM_PYTHON``, else the
    repository's ``.venv-vllm`` (scripts/setup-vllm.sh). UserError when absent."""
    root = Path(kvpool.__file__).resolve().parents[2]
    path = Path(given or os.environ.get("KVPOOL_VLLM_PYTHON") or root / ".venv-vllm/bin/python")
    if not path.is_file() or not (path.parent / "vllm").is_file():
        raise UserError(f"vLLM not found at {path}: run scripts/setup-vllm.sh, or give "
                        "--vllm-python / KVPOOL_VLLM_PYTHON")
    return path


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def prometheus_sums(text: str, names: tuple[str, ...]) -> dict[str, float]:
    """Sum of every sample of each metric in ``names`` (labels ignored) in a Prometheus
    text exposition."""
    out = dict.fromkeys(names, 0.0)
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in out:
            out[name] += float(line.rsplit(" ", 1)[1])
    return out


VLLM_COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                 "vllm:external_prefix_cache_queries_total",
                 "vllm:external_prefix_cache_hits_total")
KVPOOL_COUNTERS = ("kvpool_vllm_bytes_loaded_total", "kvpool_vllm_bytes_saved_total",
                   "kvpool_vllm_blocks_loaded_total", "kvpool_vllm_fetch_skipped_blocks_total")


class Fleet:
    """``instances`` vLLM servers of one kind (module docstring); a context manager.

    Args:
        kind: one of :data:`KINDS`.
        model: the model folder vLLM serves.
        log_dir: where each server's log goes (``<kind>-<i>.log``).
        master, segments: the kvpool store (kind ``kvpool``).
        example_dir: ExampleConnector's shared folder (kind ``example``).
        max_model_len: vLLM's context limit; python: vLLM's interpreter.
        kv_blocks: blocks of KV cache each instance holds (``--num-gpu-blocks-override``,
            ``BLOCK_SIZE`` tokens each: the HBM a GPU would give it); None: what
            ``VLLM_CPU_KVCACHE_SPACE`` (1 GiB) holds.
    """

    def __init__(self, kind: str, model: str, log_dir: Path, instances: int = 2,
                 master: str = "", segments: list[str] = (), example_dir: Path | None = None,
                 max_model_len: int = 4096, python: Path | None = None,
                 startup_timeout_s: float = 900.0, kv_blocks: int | None = None):
        if kind not in KINDS:
            raise UserError(f"server kind must be one of {', '.join(KINDS)}, got {kind!r}")
        self.kind, self.model, self.log_dir, self.n = kind, model, Path(log_dir), instances
        self.master, self.segments, self.example_dir = master, list(segments), example_dir
        self.max_model_len, self.python = max_model_len, python or vllm_python(None)
        self.startup_timeout_s = startup_timeout_s
        self.kv_blocks = kv_blocks
        self.procs: list[subprocess.Popen] = []
        self.ports: list[int] = []
        self.metrics_ports: list[int] = []
        self.startup_s = 0.0
        self.rpc_dir: str | None = None  # the servers' ZeroMQ IPC sockets, removed by stop()

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{p}" for p in self.ports]

    def _connector(self, i: int) -> dict | None:
        if self.kind == "example":
            return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                    "kv_connector_extra_config": {"shared_storage_path": str(self.example_dir)}}
        if self.kind == "kvpool":
            return {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "kvpool.integrations.vllm",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"master": self.master,
                                                  "segment": self.segments[i],
                                                  "metrics_port": self.metrics_ports[i]}}
        return None

    def _env(self, i: int) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's own process layout
        src = str(Path(kvpool.__file__).resolve().parents[1])
        env.update({"PYTHONPATH": src, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
                    "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1)),
                    "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                    # vLLM names an IPC socket per process in $TMPDIR and leaves it behind when
                    # stopped: a folder of the fleet's own, removed with it
                    "VLLM_RPC_BASE_PATH": self.rpc_dir})
        return env

    def start(self) -> "Fleet":
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.rpc_dir = self.rpc_dir or tempfile.mkdtemp(prefix="kvpool-rpc-")  # short: socket paths
        self.ports = [free_port() for _ in range(self.n)]
        self.metrics_ports = [free_port() for _ in range(self.n)]
        t0 = time.monotonic()
        for i in range(self.n):
            with open(self.log_path(i), "w") as log:
                self.procs.append(spawn(
                    self.command(i), stdout=log, stderr=subprocess.STDOUT, env=self._env(i),
                    start_new_session=True))
        try:
            self._wait_healthy(t0 + self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def command(self, i: int) -> list[str]:
        """The ``vllm serve`` command line of instance ``i`` (its port assigned)."""
        cmd = [str(self.python.parent / "vllm"), "serve", self.model, "--dtype", "float32",
               "--block-size", str(BLOCK_SIZE), "--enforce-eager", "--max-model-len", str(self.max_model_len),
               "--port", str(self.ports[i]), "--host", "127.0.0.1",
               "--enable-prompt-tokens-details", "--prefix-caching-hash-algo", HASH_ALGO]
        if self.kv_blocks:
            cmd += ["--num-gpu-blocks-override", str(self.kv_blocks)]
        conn = self._connector(i)
        if conn:
            cmd += ["--kv-transfer-config", json.dumps(conn)]
        return cmd

    def log_path(self, i: int) -> Path:
        return self.log_dir / f"{self.kind}-{i}.log"

    def _wait_healthy(self, deadline: float) -> None:
        pending = set(range(self.n))
        while pending:
            for i in sorted(pending):
                if self.procs[i].poll() is not None:
                    tail = self.log_path(i).read_text()[-3000:]
                    raise UserError(f"vllm serve ({self.kind} {i}) exited with "
                                    f"{self.procs[i].returncode}; log {self.log_path(i)}:\n{tail}")
                try:
                    _get(f"{self.urls[i]}/health")
                    pending.discard(i)
                except (urllib.error.URLError, ConnectionError, TimeoutError):
                    pass
            if pending and time.monotonic() > deadline:
                raise UserError(f"vllm serve ({self.kind}) not healthy within "
                                f"{self.startup_timeout_s:.0f} s; logs in {self.log_dir}")
            if pending:
                time.sleep(1.0)  # poll interval of the health checks (deadline above)

    def counters(self) -> list[dict[str, float]]:
        """Per instance: vLLM's prefix-cache counters and, for kvpool, the connector's."""
        out = []
        for i in range(self.n):
            c = prometheus_sums(_get(f"{self.urls[i]}/metrics"), VLLM_COUNTERS)
            if self.kind == "kvpool":
                c.update(prometheus_sums(_get(f"http://127.0.0.1:{self.metrics_ports[i]}/metrics"),
                                         KVPOOL_COUNTERS))
            out.append(c)
        return out

    def dead(self, wait_s: float = 0.0) -> list[str]:
        """One line per server that has exited: its index, exit status and the last
        error its log names (a server that died mid-run, e.g. of its connector).
        ``wait_s``: how long to wait for one to exit (an API server outlives its dead
        engine by a few seconds, refusing connections meanwhile)."""
        deadline = time.monotonic() + wait_s
        while all(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            try:
                self.procs[0].wait(timeout=0.5)  # a bounded wait per look at the others
            except subprocess.TimeoutExpired:
                pass
        out = []
        for i, p in enumerate(self.procs):
            if p.poll() is None:
                continue
            lines = [ln for ln in self.log_path(i).read_text(errors="replace").splitlines()
                     if "Error" in ln and ":" in ln]
            out.append(f"{self.kind} {i} exited with {p.returncode}"
                       + (f": {lines[-1].strip()[:300]}" if lines else ""))
        return out

    def stop(self) -> None:
        """SIGTERM each server's process group (API server and engine core), SIGKILL
        after 60 s."""
        for p in self.procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                    p.wait(timeout=10)  # bounded: see kvpool.child.wait_or_kill
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    pass
        self.procs = []
        if self.rpc_dir:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)
            self.rpc_dir = None

    def __enter__(self) -> "Fleet":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def counter_delta(before: list[dict], after: list[dict]) -> dict[str, float]:
    """Counters summed over instances, ``after − before``."""
    total: dict[str, float] = {}
    for b, a in zip(before, after):
        for k, v in a.items():
            total[k] = total.get(k, 0.0) + v - b.get(k, 0.0)
    return total
