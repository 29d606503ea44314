"""The connector's fetch-or-recompute policy on a real vLLM engine: a hit whose load the
planner predicts slower than recomputing it (a link far too slow) is skipped and
counted; vLLM computes the prompt itself, with the same tokens."""

from __future__ import annotations

import pytest

from kvpool.launch import Cluster
from vllm_harness import QUESTIONS, connector, model_folder, require_vllm, run_instance

pytestmark = pytest.mark.slow


def test_a_fetch_predicted_slower_than_recompute_is_skipped(tmp_path):
    require_vllm()
    model = model_folder()
    prompts = [{"question": QUESTIONS[1], "max_tokens": 4}]
    with Cluster(segment_size="512MiB") as c:
        first = run_instance(tmp_path, "first", {"model": model, "prompts": prompts,
                                                 "connector": connector(c.master_addr)})
        slow = run_instance(tmp_path, "slow", {"model": model, "prompts": prompts,
                                               "connector": connector(c.master_addr,
                                                                      link_gbit=1e-5)})
    saved = first["metrics"]["kvpool_vllm_blocks_saved_total"]
    assert saved > 0
    m = slow["metrics"]
    assert m["kvpool_vllm_lookup_blocks_total{result=hit}"] > 0  # it was there ...
    assert m["kvpool_vllm_fetch_skipped_blocks_total"] == m["kvpool_vllm_lookup_blocks_total{result=hit}"]
    assert m.get("kvpool_vllm_blocks_loaded_total", 0) == 0      # ... and not loaded
    assert slow["prompts"][0]["num_cached_tokens"] == 0
    assert slow["prompts"][0]["output_ids"] == first["prompts"][0]["output_ids"]
