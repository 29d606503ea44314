"""`kvpool plan kv`: KV bytes from config.json, checked against hand-computed values.

Every expected number is written out from the model's published shape, not from the
planner's code: layers x KV heads x head_dim x 2 (K and V) x bytes per element.
"""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main
from kvpool.errors import UserError
from kvpool.plan import configs_dir, load_spec, plan_kv, spec_from_config

BF16, FP32, FP8 = 2, 4, 1


def kv(name, dtype="bf16", **kw):
    return plan_kv(load_spec(name), dtype, **kw)


@pytest.mark.parametrize("name, per_token", [
    ("llama-3-8b", 32 * 8 * 128 * 2 * BF16),       # 131,072
    ("llama-3-70b", 80 * 8 * 128 * 2 * BF16),      # 327,680
    ("qwen2.5-7b", 28 * 4 * 128 * 2 * BF16),       # 57,344: use_sliding_window false
    ("mistral-7b", 32 * 8 * 128 * 2 * BF16),       # 131,072 per token, window 4096
    ("gemma-2-9b", 42 * 8 * 256 * 2 * BF16),       # 344,064
    ("deepseek-v3", 61 * (512 + 64) * BF16),       # 70,272
    ("deepseek-v3.2-exp", 61 * (512 + 64 + 128) * BF16),  # latent + indexer key
    ("kimi-linear-48b-a3b", 7 * (512 + 64) * BF16),  # only the 7 MLA layers grow
    ("smollm2-135m", 30 * 3 * 64 * 2 * BF16),
    ("qwen3-next-80b-a3b", 12 * 2 * 256 * 2 * BF16),  # 24,576: 12 of 48 layers attend
    ("gpt-oss-20b", 24 * 8 * 64 * 2 * BF16),       # 49,152 per token, half capped at 128
    ("gemma-3-27b-it", 62 * 16 * 128 * 2 * BF16),  # 507,904 per token, 52 capped at 1024
    ("nemotron-h-8b", 4 * 8 * 128 * 2 * BF16),     # 16,384: the pattern's 4 '*' layers
    ("jamba-v0.1", 4 * 8 * 128 * 2 * BF16),        # 16,384: attention every 8th layer
])
def test_bytes_per_token_of_every_shipped_config(name, per_token):
    assert kv(name).per_token == per_token


def test_every_shipped_config_is_tested_here():
    shipped = {p.stem for p in configs_dir().glob("*.json")}
    assert shipped == {"llama-3-8b", "llama-3-70b", "qwen2.5-7b", "mistral-7b", "gemma-2-9b",
                       "deepseek-v3", "deepseek-v3.2-exp", "kimi-linear-48b-a3b", "smollm2-135m",
                       "qwen3-next-80b-a3b", "gpt-oss-20b", "gemma-3-27b-it", "nemotron-h-8b",
                       "jamba-v0.1"}


def test_smollm2_fp32_is_45_kib_per_token():
    assert kv("smollm2-135m", "fp32").per_token == 46_080 == 30 * 3 * 64 * 2 * FP32


def test_fp8_halves_bf16():
    assert kv("llama-3-8b", "fp8").per_token == 32 * 8 * 128 * 2 * FP8


def test_page_request_and_pool_scale_with_tokens():
    p = kv("llama-3-8b", tokens=1000, requests=3, page_size=32)
    assert p.per_page == 131_072 * 32
    assert p.per_request == 131_072 * 1000
    assert p.pool == 131_072 * 1000 * 3


def test_mistral_sliding_window_caps_the_request_at_4096_tokens():
    p = kv("mistral-7b", tokens=32_768)
    assert p.per_request == 131_072 * 4096
    assert kv("mistral-7b", tokens=1000).per_request == 131_072 * 1000


def test_gemma2_alternates_sliding_and_global_layers():
    p = kv("gemma-2-9b", tokens=8192)
    per_layer = 8 * 256 * 2 * BF16
    assert p.per_request == 21 * per_layer * 8192 + 21 * per_layer * 4096
    kinds = {g.kind: (g.count, g.layers) for g in p.groups}
    assert kinds == {"sliding": (21, "0-40 step 2"), "full": (21, "1-41 step 2")}


def test_qwen2_slides_only_when_use_sliding_window_is_true():
    cfg = json.loads((configs_dir() / "qwen2.5-7b.json").read_text())
    cfg.update(use_sliding_window=True, sliding_window=4096, max_window_layers=20)
    p = plan_kv(spec_from_config(cfg), "bf16", tokens=8192)
    per_layer = 4 * 128 * 2 * BF16
    assert p.per_request == 20 * per_layer * 8192 + 8 * per_layer * 4096


def test_layer_types_and_sliding_window_pattern():
    base = dict(num_hidden_layers=6, hidden_size=256, num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, intermediate_size=512, vocab_size=1000,
                sliding_window=100)
    per_layer = 2 * 64 * 2 * BF16
    typed = {**base, "layer_types": ["sliding_attention"] * 5 + ["full_attention"]}
    pattern = {**base, "sliding_window_pattern": 6}  # Gemma 3: every 6th layer global
    for cfg in (typed, pattern):
        p = plan_kv(spec_from_config(cfg), "bf16", tokens=1000)
        assert p.per_request == 5 * per_layer * 100 + 1 * per_layer * 1000


def test_mla_latent_is_replicated_across_tp_ranks():
    p = kv("deepseek-v3", tp=8)
    assert p.per_token_rank == p.per_token == 70_272
    assert p.pool_all_ranks == 8 * p.pool


def test_deepseek_v32_indexer_key_is_cached_per_token():
    assert kv("deepseek-v3.2-exp").per_token - kv("deepseek-v3").per_token == 61 * 128 * BF16


def test_gqa_heads_split_over_tp_then_replicate():
    assert kv("llama-3-70b", tp=4).per_token_rank == 80 * 2 * 128 * 2 * BF16   # 8 heads / 4
    assert kv("llama-3-70b", tp=8).per_token_rank == 80 * 1 * 128 * 2 * BF16
    p16 = kv("llama-3-70b", tp=16)  # 8 heads on 16 ranks: one head each, 2 copies
    assert p16.per_token_rank == 80 * 1 * 128 * 2 * BF16
    assert p16.pool_all_ranks == 2 * p16.pool


def test_tp_that_vllm_refuses_is_a_value_error_with_the_reason():
    # llama-3-8b: 32 query heads, 8 KV heads; vLLM needs 32 % tp == 0
    with pytest.raises(ValueError, match="32 attention heads.*sizes that fit: 1, 2, 4, 8, 16, 32"):
        kv("llama-3-8b", tp=3)
    # qwen2.5-7b: 28 query heads, 4 KV heads; 7 and 14 divide 28 but split 4 KV heads unevenly
    for tp in (7, 14):
        with pytest.raises(ValueError, match="4 KV heads"):
            kv("qwen2.5-7b", tp=tp)
    assert kv("qwen2.5-7b", tp=28).pool_all_ranks == 7 * kv("qwen2.5-7b").pool  # replicated 7x
    assert kv("llama-3-8b", tp=32).per_token_rank == 32 * 1 * 128 * 2 * BF16
    with pytest.raises(UserError):  # the CLI prints it as one line
        kv("llama-3-8b", tp=3)


def test_cli_refuses_a_tp_that_does_not_split_the_heads(capsys):
    assert main(["plan", "kv", "llama-3-8b", "--tp", "3"]) == 2
    err = capsys.readouterr().err
    assert "--tp 3" in err and "num_attention_heads % tp == 0" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(["plan", "prefill", "qwen2.5-7b", "--prompt", "100", "--tp", "7"]) == 2
    assert "4 KV heads" in capsys.readouterr().err


def test_pp_splits_layers_and_sizes_for_the_largest_stage():
    p = kv("deepseek-v3", pp=2)  # 61 layers -> stages of 31 and 30
    assert p.per_token_rank == 31 * 576 * BF16
    assert p.pool_all_ranks == p.pool
    assert kv("llama-3-8b", tp=2, pp=4).per_token_rank == 8 * 4 * 128 * 2 * BF16


def test_kimi_linear_hybrid_has_a_fixed_state_per_request():
    # KDA layer: 32 heads x (128 x 128 state) + conv over q, k, v: 3 x 32 x 128 x (4 - 1)
    state_per_layer = 32 * 128 * 128 + 3 * 32 * 128 * 3
    p = kv("kimi-linear-48b-a3b", tokens=1000)
    assert p.state_per_request == 20 * state_per_layer * BF16
    assert p.per_request == 7 * 576 * BF16 * 1000 + 20 * state_per_layer * BF16
    assert kv("kimi-linear-48b-a3b", tokens=2000).per_request - p.per_request == 7 * 576 * 2 * 1000
    groups = {g.kind: (g.count, g.layers) for g in p.groups}
    assert groups["mla"] == (7, "3,7,11,15,19,23,26")  # 1-based 4,8,...,24,27 in the config
    # the state splits over TP by heads; the MLA latent does not
    p4 = kv("kimi-linear-48b-a3b", tokens=1000, tp=4)
    assert p4.per_request_rank == 7 * 576 * BF16 * 1000 + 20 * state_per_layer // 4 * BF16


def test_mamba2_layers_from_layer_types():
    cfg = dict(num_hidden_layers=4, hidden_size=512, num_attention_heads=8,
               num_key_value_heads=2, head_dim=64, intermediate_size=1024, vocab_size=1000,
               layer_types=["mamba", "mamba", "mamba", "attention"], mamba_n_heads=16,
               mamba_d_head=64, mamba_d_state=128, mamba_n_groups=1, mamba_d_conv=4)
    p = plan_kv(spec_from_config(cfg), "fp32", tokens=10)
    state = 16 * 64 * 128 + (16 * 64 + 2 * 128) * 3
    assert p.state_per_request == 3 * state * FP32
    assert p.per_token == 2 * 64 * 2 * FP32


def test_missing_field_is_named():
    cfg = json.loads((configs_dir() / "llama-3-8b.json").read_text())
    del cfg["num_key_value_heads"]
    with pytest.raises(UserError, match="num_key_value_heads"):
        spec_from_config(cfg)
    with pytest.raises(UserError, match="kv_lora_rank|qk_rope_head_dim"):
        spec_from_config({**json.loads((configs_dir() / "deepseek-v3.json").read_text()),
                          "qk_rope_head_dim": None})


def test_unknown_layer_type_and_unsupported_fields_are_refused():
    cfg = json.loads((configs_dir() / "llama-3-8b.json").read_text())
    with pytest.raises(UserError, match="layer_types.*'weird'"):
        spec_from_config({**cfg, "layer_types": ["weird"] * 32})
    with pytest.raises(UserError, match="attention_chunk_size"):
        spec_from_config({**cfg, "attention_chunk_size": 8192})


def test_head_dim_from_hidden_size_when_absent():
    # Llama-3-8B's config has no head_dim: 4096 / 32 = 128
    assert "head_dim" not in json.loads((configs_dir() / "llama-3-8b.json").read_text())
    assert kv("llama-3-8b").per_token == 32 * 8 * 128 * 2 * BF16


def test_cli_json_output(capsys):
    assert main(["plan", "kv", "llama-3-8b", "--tokens", "8192", "--requests", "4", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["per_token"] == 131_072
    assert out["pool"] == 131_072 * 8192 * 4
    assert out["groups"][0]["kind"] == "full"


def test_cli_text_and_path(capsys):
    path = configs_dir() / "deepseek-v3.json"
    assert main(["plan", "kv", str(path), "--tp", "8"]) == 0
    out = capsys.readouterr().out
    assert "70,272 B" in out and "MLA latent" in out


def test_cli_user_errors_are_one_line(tmp_path, capsys):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"num_hidden_layers": 2, "hidden_size": 64}))
    assert main(["plan", "kv", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "num_attention_heads" in err and "Traceback" not in err
    assert main(["plan", "kv", str(tmp_path / "missing.json")]) == 2
    assert main(["plan", "kv", "llama-3-8b", "--tokens", "0"]) == 2
    (tmp_path / "broken.json").write_text("{not json")
    assert main(["plan", "kv", str(tmp_path / "broken.json")]) == 2


@pytest.mark.parametrize("name, config_class", [
    ("kimi-linear-48b-a3b", "KimiLinearConfig"), ("gemma-2-9b", "Gemma2Config"),
    ("qwen2.5-7b", "Qwen2Config"), ("mistral-7b", "MistralConfig"),
    ("deepseek-v3", "DeepseekV3Config"),
])
def test_transformers_normalised_config_gives_the_same_plan(name, config_class):
    """transformers rewrites these configs (explicit layer_types, renamed fields) when it
    saves them; both spellings must size the cache the same."""
    transformers = pytest.importorskip("transformers")
    raw = json.loads((configs_dir() / f"{name}.json").read_text())
    saved = getattr(transformers, config_class)(**raw).to_dict()
    assert (plan_kv(spec_from_config(saved), "bf16", tokens=8192).per_request
            == plan_kv(spec_from_config(raw), "bf16", tokens=8192).per_request)
