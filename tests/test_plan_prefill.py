"""`kvpool plan prefill`: the causal-triangle model, break-even bandwidth and the fit.

No timing is asserted: the fit is checked on synthetic runs built from known speeds.
"""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main
from kvpool.errors import UserError
from kvpool.plan import load_spec, plan_kv
from kvpool.plan.fit import fit_cold
from kvpool.plan.measure import fit_lengths
from kvpool.plan.prefill import (Rates, break_even_bandwidth, cached_tokens, causal_pairs,
                                 predict_ttft, prefill_flops, prefill_report)

SMOL = load_spec("smollm2-135m")
# SmolLM2-135M: 30 layers, 9 query heads of 64, 3 KV heads, MLP 1536, vocab 49152
SMOL_LINEAR_PER_TOKEN = 30 * 2 * (576 * 64 * (2 * 9 + 2 * 3) + 3 * 576 * 1536)
SMOL_PAIR = 30 * 2 * 9 * 2 * 64  # QK^T + AV per (query, key) pair, all layers


def test_causal_pairs_is_the_triangle_minus_the_cached_corner():
    assert causal_pairs(4, 0) == 1 + 2 + 3 + 4
    assert causal_pairs(4, 2) == 3 + 4
    n, p = 2048, 1024
    assert causal_pairs(n, p) == (n * (n + 1) - p * (p + 1)) // 2
    assert causal_pairs(10, 0, cap=3) == 1 + 2 + 3 + 3 * 7  # window caps keys per query


def test_smollm2_flops_from_its_shape():
    f = prefill_flops(SMOL, 1000, 0)
    assert f.linear == SMOL_LINEAR_PER_TOKEN * 1000 + 2 * 576 * 49152  # LM head: last token
    assert f.attention == SMOL_PAIR * 1000 * 1001 // 2


def test_attention_left_is_n2_minus_p2():
    n, p = 4096, 2048
    cold, hit = prefill_flops(SMOL, n, 0), prefill_flops(SMOL, n, p)
    assert hit.attention / cold.attention == pytest.approx((n * n - p * p) / (n * n), rel=1e-3)
    assert (hit.linear - 2 * 576 * 49152) / (cold.linear - 2 * 576 * 49152) == 0.5


@pytest.mark.parametrize("name", ["smollm2-135m", "llama-3-8b", "deepseek-v3",
                                  "kimi-linear-48b-a3b"])
def test_half_hit_is_less_than_2x_even_ideally(name):
    r = prefill_report(load_spec(name), 8192, 0.5, Rates())
    assert 1.0 < r.ideal_speedup < 2.0
    assert r.predicted_speedup < r.ideal_speedup  # load and overhead only take away
    assert "less than the 2.00x that reusing 50.0% of the tokens suggests" in r.explanation


def test_speedup_gets_worse_with_longer_prompts():
    short = prefill_report(SMOL, 512, 0.5, Rates()).ideal_speedup
    long = prefill_report(SMOL, 16384, 0.5, Rates()).ideal_speedup
    assert long < short < 2.0


def test_sliding_window_attention_is_capped():
    mistral = load_spec("mistral-7b")
    f = prefill_flops(mistral, 8192, 0)
    pair = 32 * 2 * 32 * 2 * 128
    assert f.attention == pair * (4096 * 4097 // 2 + 4096 * 4096)


def test_ttft_parts_and_load_bytes():
    rates = Rates(linear=100e9, attention=50e9, overhead_s=0.01, bandwidth=2e9)
    t = predict_ttft(SMOL, 2048, 1024, rates, "fp32")
    assert t.load_bytes == 1024 * 46_080
    assert t.load == pytest.approx(1024 * 46_080 / 2e9)
    f = prefill_flops(SMOL, 2048, 1024)
    assert t.linear == pytest.approx(f.linear / 100e9)
    assert t.attention == pytest.approx(f.attention / 50e9)
    assert t.total == pytest.approx(0.01 + t.linear + t.attention + t.load)


def test_break_even_bandwidth_formula():
    rates = Rates(linear=100e9, attention=50e9, overhead_s=0.0, bandwidth=1e9)
    n, p = 2048, 1536
    cold, warm = prefill_flops(SMOL, n, 0), prefill_flops(SMOL, n, p)
    saved_s = (cold.linear - warm.linear) / 100e9 + (cold.attention - warm.attention) / 50e9
    be = break_even_bandwidth(SMOL, n, p, rates, "fp32")
    assert be == pytest.approx(p * 46_080 / saved_s)
    # at exactly that bandwidth, fetching and recomputing take the same time
    at_be = Rates(linear=100e9, attention=50e9, overhead_s=0.0, bandwidth=be)
    assert predict_ttft(SMOL, n, p, at_be, "fp32").total == pytest.approx(
        predict_ttft(SMOL, n, 0, at_be, "fp32").total)


def test_hybrid_load_includes_the_state():
    kimi = load_spec("kimi-linear-48b-a3b")
    t = predict_ttft(kimi, 4096, 2048, Rates(), "bf16")
    assert t.load_bytes == plan_kv(kimi, "bf16", tokens=2048).per_request


def test_cached_tokens_rounds_down_to_pages_and_keeps_the_last_token():
    assert cached_tokens(2048, 0.5, 16) == 1024
    assert cached_tokens(1000, 0.9, 16) == 896
    assert cached_tokens(16, 0.99, 16) == 0
    with pytest.raises(UserError):
        cached_tokens(100, 1.0)
    with pytest.raises(UserError):
        prefill_flops(SMOL, 10, 10)


def test_fit_recovers_known_speeds_from_cold_runs():
    lin, attn, over = 120e9, 40e9, 0.05
    runs = []
    for n in fit_lengths(2048, 16):
        f = prefill_flops(SMOL, n, 0)
        runs.append((n, over + f.linear / lin + f.attention / attn))
    fit = fit_cold(SMOL, runs)
    assert fit.linear_flops == pytest.approx(lin, rel=1e-6)
    assert fit.attention_flops == pytest.approx(attn, rel=1e-6)
    assert fit.overhead_s == pytest.approx(over, rel=1e-6)
    assert fit.max_rel_error < 1e-9


def test_fit_keeps_speeds_non_negative():
    # times that fall with length would need a negative cost: the fit clamps it
    fit = fit_cold(SMOL, [(128, 0.3), (256, 0.2), (512, 0.25), (1024, 0.4)])
    assert fit.overhead_s >= 0 and fit.linear_flops > 0 and fit.attention_flops > 0
    with pytest.raises(UserError):
        fit_cold(SMOL, [(128, 0.3), (256, 0.2)])


def test_cli_prefill_json(capsys):
    assert main(["plan", "prefill", "smollm2-135m", "--prompt", "2048", "--hit", "0.5",
                 "--kv-dtype", "fp32", "--bandwidth", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["cached"] == 1024
    assert out["attention_fraction_left"] == pytest.approx(0.75, abs=1e-3)
    assert out["load_bytes"] == 1024 * 46_080
    assert out["ideal_speedup"] < 2.0


def test_cli_prefill_text_explains(capsys):
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "8192", "--hit", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "break-even bandwidth" in out and "whole cached prefix" in out
    assert main(["plan", "prefill", "llama-3-8b", "--prompt", "100", "--hit", "1.5"]) == 2


def test_masked_kernel_computes_the_whole_rectangle_after_a_prefix():
    n, p = 2048, 1024
    masked = prefill_flops(SMOL, n, p, kernel="masked")
    assert masked.attention == SMOL_PAIR * (n - p) * n
    # at a 50% hit such a kernel saves no attention work at all
    assert masked.attention == pytest.approx(prefill_flops(SMOL, n, 0).attention, rel=1e-3)
    # a cold prefill runs the causal kernel either way
    assert prefill_flops(SMOL, n, 0, kernel="masked") == prefill_flops(SMOL, n, 0)


def test_masked_kernel_report_keeps_the_ideal_speedup():
    causal = prefill_report(SMOL, 2048, 0.5, Rates())
    masked = prefill_report(SMOL, 2048, 0.5, Rates(attention_kernel="masked"))
    assert masked.ideal_speedup == causal.ideal_speedup
    assert masked.predicted_speedup < causal.predicted_speedup
    assert masked.attention_fraction_left == pytest.approx(1.0, rel=1e-3)
    with pytest.raises(UserError):
        Rates(attention_kernel="flash")
