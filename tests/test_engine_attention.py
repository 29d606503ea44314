"""The ``kvpool_causal`` attention kernel: same results as transformers' masked SDPA,
computing only the causal pairs after a cached prefix (engine/attention.py)."""

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig

from kvpool.engine import attention
from kvpool.engine.engine import Engine
from kvpool.engine.models import load_model
from kvpool.errors import InvalidParams

PAGE = 16


class _Module(torch.nn.Module):
    def __init__(self, groups):
        super().__init__()
        self.num_key_value_groups = groups


def _reference(q, k, v):
    """Masked SDPA as transformers calls it: every query over every key, lower-right mask."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    q_len, kv_len = q.shape[2], k.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len,heads,kv_heads", [
    (37, 100, 6, 2),    # new tokens after a prefix, GQA
    (64, 64, 4, 4),     # no prefix: the causal square
    (1, 90, 6, 3),      # a decode step
    (99, 100, 4, 1),    # a one-token prefix, MQA
])
def test_kernel_matches_masked_sdpa(q_len, kv_len, heads, kv_heads):
    g = torch.Generator().manual_seed(q_len)
    q = torch.randn(1, heads, q_len, 32, generator=g)
    k = torch.randn(1, kv_heads, kv_len, 32, generator=g)
    v = torch.randn(1, kv_heads, kv_len, 32, generator=g)
    out, weights = attention.causal_attention_forward(_Module(heads // kv_heads), q, k, v, None)
    assert weights is None and out.shape == (1, q_len, heads, 32) and out.is_contiguous()
    assert (out - _reference(q, k, v)).abs().max().item() < 1e-5


def test_kernel_refuses_more_queries_than_keys_and_dropout():
    q, k = torch.randn(1, 2, 8, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(ValueError, match="keys"):
        attention.causal_attention_forward(_Module(1), q, k, k, None)
    with pytest.raises(ValueError, match="dropout"):
        attention.causal_attention_forward(_Module(1), q, q, q, None, dropout=0.1)


def test_only_plain_causal_models_get_the_kernel():
    assert attention.supports(LlamaConfig())
    assert not attention.supports(LlamaConfig(layer_types=["sliding_attention", "full_attention"],
                                              num_hidden_layers=2))


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny-random")


def test_both_kernels_give_the_cold_answer_after_a_partial_hit(tiny):
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(100, 40000, (300,), generator=g).tolist()
    answers = {}
    for kernel in attention.CHOICES:
        engine = Engine(tiny, attention=kernel)
        engine.build_cache(PAGE, 1 << 24)
        engine.generate(prompt[:100], 2)          # caches 6 pages: a 32% hit below
        warm = engine.generate(prompt, 8)
        cold = engine.generate(prompt, 8, use_cache=False)
        assert engine.attention == kernel
        assert tiny.model.config._attn_implementation == kernel
        assert warm.reused_tokens == 6 * PAGE
        assert warm.output_ids == cold.output_ids
        assert (warm.last_logits - cold.last_logits).abs().max().item() <= 1e-4
        answers[kernel] = cold
    a, b = answers.values()
    assert a.output_ids == b.output_ids
    assert (a.last_logits - b.last_logits).abs().max().item() <= 1e-4


def test_unknown_kernel_is_refused(tiny):
    with pytest.raises(InvalidParams, match="attention"):
        Engine(tiny, attention="flash")
