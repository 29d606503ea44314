"""Run real vLLM instances for tests: the interpreter of scripts/setup-vllm.sh's venv.

vLLM lives in its own virtual environment (it pins numpy/transformers versions other
than kvpool's); tests drive it through ``python -m kvpool.bench.vllm JOB OUT`` and read
the JSON it writes. ``KVPOOL_VLLM_PYTHON`` overrides the interpreter.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kvpool.engine.workload import load_workload

ROOT = Path(__file__).resolve().parent.parent
VLLM_PYTHON = Path(os.environ.get("KVPOOL_VLLM_PYTHON", ROOT / ".venv-vllm" / "bin" / "python"))
INSTANCE_TIMEOUT_S = 900
QUESTIONS = load_workload()["questions"]
BLOCK = 32  # --block-size (vLLM's CPU attention needs a multiple of 32)


def require_vllm() -> None:
    """Skip (locally) or fail (CI sets KVPOOL_REQUIRE_VLLM=1) when vLLM is not installed."""
    if VLLM_PYTHON.is_file():
        return
    message = f"vLLM is not installed at {VLLM_PYTHON}: run scripts/setup-vllm.sh"
    if os.environ.get("KVPOOL_REQUIRE_VLLM") == "1":
        pytest.fail(message)
    pytest.skip(message)


@functools.cache
def rpc_dir() -> str:
    """A folder for vLLM's ZeroMQ IPC sockets (one per process, left behind when it
    stops: 14 a test run in /tmp before), removed when the test session ends."""
    path = tempfile.mkdtemp(prefix="kvpool-rpc-")  # short: a socket path has 108 bytes at most
    atexit.register(shutil.rmtree, path, True)
    return path


def vllm_env(**extra: str) -> dict[str, str]:
    """Environment of a vLLM child: kvpool's src and tests importable, offline, quiet,
    its IPC sockets in :func:`rpc_dir`."""
    env = dict(os.environ)
    env.update({"PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT / "tests")]),
                "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "2"),
                "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
                "VLLM_RPC_BASE_PATH": rpc_dir(), **extra})
    return env


def run_instance(tmp: Path, name: str, job: dict) -> dict:
    """Run one vLLM instance for ``job`` (see kvpool.bench.vllm); returns its result.
    Its log is ``tmp/<name>.log``; raises AssertionError with the log's tail on failure."""
    job_path, out_path, log_path = (tmp / f"{name}.json", tmp / f"{name}.out.json",
                                    tmp / f"{name}.log")
    job_path.write_text(json.dumps(job))
    with open(log_path, "w") as log:
        proc = subprocess.run([str(VLLM_PYTHON), "-m", "kvpool.bench.vllm", "run", str(job_path),
                               str(out_path)], stdout=log, stderr=subprocess.STDOUT,
                              env=vllm_env(), timeout=INSTANCE_TIMEOUT_S, cwd=ROOT)
    if proc.returncode != 0:
        tail = log_path.read_text()[-4000:]
        raise AssertionError(f"vLLM instance {name} exited {proc.returncode}:\n{tail}")
    result = json.loads(out_path.read_text())
    result["log"] = log_path.read_text()
    return result


def connector(master: str, role: str = "kv_both", **extra) -> dict:
    """kv_transfer_config of KVPoolConnector (or a subclass given as module=, name=)."""
    module = extra.pop("module", "kvpool.integrations.vllm")
    name = extra.pop("name", "KVPoolConnector")
    return {"kv_connector": name, "kv_connector_module_path": module, "kv_role": role,
            "kv_load_failure_policy": "recompute",
            "kv_connector_extra_config": {"master": master, **extra}}


def model_folder() -> str:
    from kvpool.engine.model_cli import model_folder as folder

    return str(folder("smollm2", progress=lambda line: print(line, file=sys.stderr)))
