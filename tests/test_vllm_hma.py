"""KVPoolHMAConnector (vLLM's SupportsHMA), checked in vLLM's venv with its own spec classes.

vLLM disables the hybrid memory allocator on CPU, so no engine here has several KV cache
groups; tests/vllm_side/check_hma.py drives the connector's group plans, hit policies
and per-group saves and loads on CPU tensors and a real cluster instead.
"""

from __future__ import annotations

import json
import subprocess

from vllm_harness import ROOT, VLLM_PYTHON, require_vllm, vllm_env


def test_hma_groups_save_and_load_by_their_hit_policies():
    require_vllm()
    r = subprocess.run([str(VLLM_PYTHON), str(ROOT / "tests" / "vllm_side" / "check_hma.py")],
                       capture_output=True, text=True, timeout=600, env=vllm_env(), cwd=ROOT)
    assert r.returncode == 0, r.stderr[-4000:]
    checks = json.loads(r.stdout.strip().splitlines()[-1])
    assert checks and all(checks.values()), checks
