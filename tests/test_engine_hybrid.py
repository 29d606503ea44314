"""Hybrid models in the reference engine: warm runs from checkpoints and windows match cold.

Tiny random-weight models built from configs through transformers on CPU (fp32, the torch
paths of the Gated DeltaNet): Qwen3-Next's layout (3 linear-attention layers, 1 full) and
sliding windows beside full attention. The bar is the dense engine's: same greedy tokens
and last-position logits within 1e-4 of a cold run.
"""

import pytest
import torch

from engine_helpers import assert_same_answer, tokens
from kvpool.cache import DiskBackend
from kvpool.cache.hybrid import HybridCache
from kvpool.engine.engine import Engine
from kvpool.engine.layers import FULL, LINEAR, SLIDING, layer_plan
from kvpool.engine.models import TINY_QWEN3_NEXT, TINY_SLIDING, load_model, resolve_source

PAGE = 16
STEP = 4 * PAGE  # the default checkpoint spacing, in tokens


@pytest.fixture(scope="module")
def qwen3_next():
    torch.set_num_threads(1)
    return load_model(TINY_QWEN3_NEXT)


@pytest.fixture(scope="module")
def sliding():
    torch.set_num_threads(1)
    return load_model(TINY_SLIDING)


def engine(loaded, l3=None):
    eng = Engine(loaded)
    eng.build_cache(PAGE, 64 << 20, l3=l3)
    return eng


def test_the_layouts_are_read_from_the_models_cache_layers(qwen3_next, sliding):
    plan = layer_plan(qwen3_next.model)
    assert plan.kinds == (LINEAR, LINEAR, LINEAR, FULL) and plan.rows == (3,)
    # per linear layer: recurrent 4 heads x 16 x 16, conv (2*2*16 + 4*16) x (4 - 1)
    assert plan.state_numel == 3 * (4 * 16 * 16 + 128 * 3)
    plan = layer_plan(sliding.model)
    assert plan.kinds == (SLIDING, SLIDING, SLIDING, FULL) and plan.window == 48
    assert plan.rows == (3, 0, 1, 2)
    assert resolve_source(TINY_SLIDING) == ("tiny", TINY_SLIDING, None)


def test_qwen3_next_warm_at_a_checkpoint_matches_cold(qwen3_next):
    eng = engine(qwen3_next)
    shared = tokens(200)
    first = eng.generate(shared, max_new_tokens=4)
    assert first.reused_tokens == 0
    prompt = shared + tokens(30, seed=1)
    warm = eng.generate(prompt, max_new_tokens=8)
    cold = eng.generate(prompt, max_new_tokens=8, use_cache=False)
    assert warm.reused_tokens == 3 * STEP   # 12 full pages cached, checkpoint at 12
    assert isinstance(eng.cache, HybridCache)
    assert_same_answer(warm, cold)


def test_qwen3_next_hit_between_checkpoints_falls_back_and_is_right(qwen3_next):
    eng = engine(qwen3_next)
    shared = tokens(150)
    eng.generate(shared + tokens(50, seed=2), max_new_tokens=2)
    prompt = shared + tokens(40, seed=3)      # 9 pages shared, the checkpoint before at 8
    before = eng.cache.metrics["checkpoint_lost_tokens"]
    warm = eng.generate(prompt, max_new_tokens=8)
    assert warm.reused_tokens == 2 * STEP
    assert eng.cache.metrics["checkpoint_lost_tokens"] - before == PAGE
    assert_same_answer(warm, eng.generate(prompt, max_new_tokens=8, use_cache=False))


def test_two_requests_continuing_one_checkpoint_leave_it_untouched(qwen3_next):
    eng = engine(qwen3_next)
    shared = tokens(STEP * 2)
    eng.generate(shared + tokens(5, seed=4), max_new_tokens=2)
    for seed in (5, 6, 5):                    # the third repeats the first: same answer
        prompt = shared + tokens(20, seed=seed)
        warm = eng.generate(prompt, max_new_tokens=6)
        assert warm.reused_tokens == 2 * STEP
        assert_same_answer(warm, eng.generate(prompt, max_new_tokens=6, use_cache=False))


def test_qwen3_next_reuse_through_l3_in_a_second_engine(qwen3_next, tmp_path):
    disk = DiskBackend(tmp_path / "l3", 1 << 28)
    a, b = engine(qwen3_next, disk), engine(qwen3_next, disk)
    shared = tokens(300)
    a.generate(shared, max_new_tokens=2)
    a.cache.flush()
    prompt = shared + tokens(12, seed=7)
    warm = b.generate(prompt, max_new_tokens=6)
    assert warm.reused_tokens == 4 * STEP and warm.reused_by_tier == {"L3": 4 * STEP}
    assert b.cache.metrics["state_pages_loaded_l3"] == 1
    assert_same_answer(warm, b.generate(prompt, max_new_tokens=6, use_cache=False))


def test_sliding_window_warm_loads_only_the_window_and_matches_cold(sliding):
    eng = engine(sliding)
    shared = tokens(160)
    eng.generate(shared, max_new_tokens=2)
    prompt = shared + tokens(25, seed=8)
    warm = eng.generate(prompt, max_new_tokens=8)
    assert warm.reused_tokens == 160
    # a 48-token window at token 160 reaches back to token 113: pages 7, 8, 9 only
    assert eng.cache.metrics["window_pages_skipped"] == 7
    assert_same_answer(warm, eng.generate(prompt, max_new_tokens=8, use_cache=False))
    # that turn held window pages from 7 on only and stored those and its own pages 10:
    # the next one hits all 11 stored pages (window 8..10), and is still right
    longer = prompt + warm.output_ids + tokens(20, seed=9)
    again = eng.generate(longer, max_new_tokens=6)
    assert again.reused_tokens == 176
    assert_same_answer(again, eng.generate(longer, max_new_tokens=6, use_cache=False))
