"""Prefix-KV reuse in the reference engine matches a cold prefill (fp32), across processes.

Real clusters (master + node processes) and real engine processes; no mocks. The
correctness bar of issue 2: same greedy tokens and last-position logits within 1e-4.
"""

import numpy as np
import pytest
import torch

from engine_helpers import TOL, assert_same_answer, tokens
from kvpool.cache import StoreBackend, page_keys, store_key
from kvpool.client import Client
from kvpool.engine.engine import Engine
from kvpool.engine.models import load_model
from kvpool.engine.procs import EngineProcess, EngineProcessError, decode_logits

PAGE = 16

@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)  # servers run beside the model
    return load_model("tiny-random")


def test_reuse_across_two_engine_processes_through_the_store_matches_cold(cluster, tmp_path):
    args = ["--model", "tiny-random", "--master", cluster.master_addr,
            "--page-size", str(PAGE), "--threads", "1"]
    a = EngineProcess("A", args, tmp_path / "a.log")
    b = EngineProcess("B", args, tmp_path / "b.log")
    try:
        a.wait_ready()
        b.wait_ready()
        shared = tokens(300)
        first = a.call({"prompt_ids": shared + tokens(20, seed=1), "max_new_tokens": 6})
        assert first["reused_tokens"] == 0
        prompt = shared + tokens(25, seed=2)
        warm = b.call({"prompt_ids": prompt, "max_new_tokens": 6})
        cold = b.call({"prompt_ids": prompt, "max_new_tokens": 6, "use_cache": False})
        # a bad request gets an error reply and the engine keeps serving
        with pytest.raises(EngineProcessError, match="token ids"):
            b.call({"prompt_ids": [10**9]})
        assert b.call({"prompt_ids": prompt[:40], "max_new_tokens": 1})["reused_tokens"] == 32
    finally:
        a.stop()
        b.stop()
    # B had nothing in L1: the 18 full pages of the shared prefix came from A via the store
    assert warm["reused_by_tier"] == {"L3": 18 * PAGE}
    assert warm["reused_tokens"] == 18 * PAGE
    assert cold["reused_tokens"] == 0
    assert warm["output_ids"] == cold["output_ids"]
    dlogit = np.abs(decode_logits(warm["last_logits"]) - decode_logits(cold["last_logits"]))
    assert dlogit.max() <= TOL


def test_k15_prompt_of_exact_pages_still_computes_its_last_token(tiny):
    engine = Engine(tiny)
    engine.build_cache(PAGE, 1 << 24)
    prompt = tokens(4 * PAGE)
    first = engine.generate(prompt, 5)
    again = engine.generate(prompt, 5)
    cold = engine.generate(prompt, 5, use_cache=False)
    # N pages sent twice: N-1 reused, the last page (and so the last token) computed
    assert first.reused_tokens == 0
    assert again.reused_tokens == 3 * PAGE
    assert again.reused_by_tier == {"L1": 3 * PAGE}
    assert_same_answer(again, cold)
    assert_same_answer(first, cold)
    # the chain is intact: a longer prompt reuses all 4 pages
    longer = engine.generate(prompt + tokens(3, seed=9), 5)
    assert longer.reused_tokens == 4 * PAGE


def test_corrupted_stored_page_is_a_miss_and_the_answer_is_still_right(tiny, module_cluster):
    prompt = tokens(6 * PAGE + 5, seed=3)
    with Client(module_cluster.master_addr) as client:
        writer = Engine(tiny)
        writer.build_cache(PAGE, 1 << 24, l3=StoreBackend(client))
        writer.generate(prompt, 4)
        writer.cache.flush()
        # flip one payload byte of page 2 in the store (header intact: only the checksum
        # can tell)
        key = store_key(page_keys(writer.cache.ns, prompt)[2])
        blob = bytearray(client.get(key))
        blob[-1] ^= 0xFF
        client.upsert(key, bytes(blob))

        reader = Engine(tiny)
        reader.build_cache(PAGE, 1 << 24, l3=StoreBackend(client))
        warm = reader.generate(prompt, 4)
        cold = reader.generate(prompt, 4, use_cache=False)
        rejects = reader.cache.metrics.snapshot()
        client.remove_all(force=True)
    # pages 0 and 1 are used; page 2 fails its checksum and ends the reused prefix
    assert warm.reused_tokens == 2 * PAGE
    assert warm.reused_by_tier == {"L3": 2 * PAGE}
    assert rejects["page_rejects"] == 1
    assert_same_answer(warm, cold)


@pytest.mark.slow
def test_smollm2_reuse_matches_cold_prefill():
    torch.set_num_threads(1)
    engine = Engine("smollm2")
    engine.build_cache(PAGE, 1 << 28)
    text = ("The Marrow Valley canal carried slate from the quarries to the sea. " * 30)
    messages = [{"role": "user", "content": text + "Where did the slate go?"}]
    from kvpool.engine.workload import chat_prompt_ids

    prompt = chat_prompt_ids(engine.loaded.tokenizer, messages)
    assert 300 <= len(prompt) <= 600
    engine.generate(prompt[:-7], 3)
    warm = engine.generate(prompt, 6)
    cold = engine.generate(prompt, 6, use_cache=False)
    assert warm.reused_tokens == (len(prompt) - 7) // PAGE * PAGE
    assert_same_answer(warm, cold)


def test_l3_pages_load_checked_in_place_and_reach_l1_after_the_request(tiny, module_cluster):
    prompt = tokens(8 * PAGE + 3, seed=4)
    with Client(module_cluster.master_addr) as client:
        writer = Engine(tiny)
        writer.build_cache(PAGE, 1 << 24, l3=StoreBackend(client))
        writer.generate(prompt, 3)
        writer.cache.flush()
        keys = [store_key(k) for k in page_keys(writer.cache.ns, prompt)]
        # page 5 grows by a byte: larger than the slot a reader gives it (a length reject)
        client.upsert(keys[5], client.get(keys[5]) + b"\0")

        reader = Engine(tiny)
        reader.build_cache(PAGE, 1 << 24, l3=StoreBackend(client))
        warm = reader.generate(prompt, 3)
        metrics = reader.cache.metrics.snapshot()
        again = reader.generate(prompt, 3)
        cold = reader.generate(prompt, 3, use_cache=False)
        client.remove_all(force=True)
    assert warm.reused_by_tier == {"L3": 5 * PAGE}
    assert metrics["page_rejects"] == 1 and metrics["page_rejects_length"] == 1
    assert metrics["pages_loaded_l3"] == 5
    # the request inserted its prompt pages: the next one finds all 8 in L1
    assert again.reused_by_tier == {"L1": 8 * PAGE}
    assert_same_answer(warm, cold)
    assert_same_answer(again, cold)


class RemovedAfterLookup(StoreBackend):
    """The real store as L3; the first lookup's answer is followed by the removal of one
    page (through a second client, as an eviction or a lease running out would do), so
    that page is gone when the engine reads it."""

    def __init__(self, client, remover, key):
        super().__init__(client)
        self.remover, self.key = remover, key

    def exists(self, keys):
        found = super().exists(keys)
        if self.key is not None and self.key in keys:
            self.remover.remove(self.key, force=True)
            self.key = None
        return found


@pytest.mark.parametrize("gone", [0, 2])
def test_k21_reused_by_tier_and_hit_counters_count_what_was_loaded(tiny, module_cluster, gone):
    prompt = tokens(4 * PAGE + 3, seed=6)
    with Client(module_cluster.master_addr) as client, \
            Client(module_cluster.master_addr) as remover:
        writer = Engine(tiny)
        writer.build_cache(PAGE, 1 << 24, l3=StoreBackend(client))
        writer.generate(prompt, 3)
        writer.cache.flush()
        key = store_key(page_keys(writer.cache.ns, prompt)[gone])
        reader = Engine(tiny)
        reader.build_cache(PAGE, 1 << 24, l3=RemovedAfterLookup(client, remover, key))
        warm = reader.generate(prompt, 3)
        metrics = reader.cache.metrics.snapshot()
        cold = reader.generate(prompt, 3, use_cache=False)
        client.remove_all(force=True)
    # L3 announced 4 pages; page `gone` vanished before it was read: the engine recomputed
    assert warm.reused_tokens == gone * PAGE
    assert warm.reused_by_tier == ({"L3": gone * PAGE} if gone else {})
    assert metrics["announced_tokens_l3"] == 4 * PAGE
    assert metrics.get("hit_tokens_l3", 0) == gone * PAGE
    assert metrics["lost_tokens_l3"] == (4 - gone) * PAGE
    assert_same_answer(warm, cold)
