"""`vllm serve` (the OpenAI-compatible server) with KVPoolConnector: two instances, one
chat completion each; the second reuses the first's KV through kvpool."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import pytest

from kvpool.bench.vllm import prompt_messages
from kvpool.launch import Cluster
from kvpool.ports import free_port
from vllm_harness import (QUESTIONS, VLLM_PYTHON, connector, model_folder,
                          require_vllm, vllm_env)

pytestmark = pytest.mark.slow
STARTUP_TIMEOUT_S = 600


def _get(url: str, timeout: float = 5.0) -> int:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())


def serve_and_ask(tmp, name: str, model: str, master: str) -> dict:
    """Start `vllm serve` with the connector, wait for /health, send one chat completion,
    stop the server (its whole process group). Returns the completion's JSON."""
    port = free_port()
    cfg = connector(master)
    cmd = [str(VLLM_PYTHON.parent / "vllm"), "serve", model, "--dtype", "float32",
           "--block-size", "32", "--enforce-eager", "--max-model-len", "4096",
           "--port", str(port), "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(cfg)]
    log = open(tmp / f"{name}.log", "w")
    env = vllm_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's own process layout
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            assert proc.poll() is None, (tmp / f"{name}.log").read_text()[-3000:]
            assert time.monotonic() < deadline, f"vllm serve not healthy in {STARTUP_TIMEOUT_S} s"
            try:
                if _get(f"http://127.0.0.1:{port}/health") == 200:
                    break
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)  # poll interval of the health check (deadline above)
        return _post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": model, "messages": prompt_messages(QUESTIONS[0]), "max_tokens": 8,
            "temperature": 0})
    finally:
        stop_group(proc)
        log.close()


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group (API server and engine core), SIGKILL after 60 s."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except ProcessLookupError:
        pass  # it had exited (its log says why)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def test_two_vllm_servers_share_kv_through_kvpool(tmp_path):
    require_vllm()
    model = model_folder()
    with Cluster(segment_size="512MiB") as c:
        first = serve_and_ask(tmp_path, "serve-a", model, c.master_addr)
        second = serve_and_ask(tmp_path, "serve-b", model, c.master_addr)
    prompt_tokens = first["usage"]["prompt_tokens"]
    cached = (second["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert cached >= 0.9 * prompt_tokens
    first_cached = (first["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    assert first_cached == 0
    assert second["choices"][0]["message"]["content"] == first["choices"][0]["message"]["content"]
