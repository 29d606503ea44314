"""The vLLM connector's worker side on tensors: loads over shared memory (straight from
the segment, every layer before the forward pass or layer by layer beside it) and over
TCP (staged) give vLLM's blocks the stored bytes; a forward pass that does not wait for
its layers gets load errors, never early reads taken as good, and the worker then loads
every layer first; a corrupt or missing page is a load error, never copied as good, and
a page that failed its check is removed. Runs tests/vllm_side/check_worker.py in vLLM's environment."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from vllm_harness import ROOT, VLLM_PYTHON, require_vllm, vllm_env


def test_worker_loads_stored_blocks_and_reports_damaged_ones():
    require_vllm()
    script = Path(__file__).parent / "vllm_side" / "check_worker.py"
    r = subprocess.run([str(VLLM_PYTHON), str(script)], capture_output=True, text=True,
                       timeout=300, env=vllm_env(OMP_NUM_THREADS="1"), cwd=ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads(r.stdout.strip().splitlines()[-1])
    assert result == {"layered": "same bytes", "whole": "same bytes", "staged": "same bytes",
                      "unwaited": "recomputed, then whole", "damaged_layered": [10, 11],
                      "damaged_whole": [10, 11], "damaged_staged": [10, 11]}
