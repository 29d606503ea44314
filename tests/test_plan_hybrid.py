"""`kvpool plan kv` on hybrid models: which layers are which, KV per token for the
attention layers, the window cap of sliding ones, and the fixed state per request of
linear-attention / Mamba layers, at their own dtype.

Every expected number is written out from the model's published shape (the config
values in the shipped file, or the model code's formula quoted in the comment), not
taken from the planner's code.
"""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main
from kvpool.errors import UserError
from kvpool.plan import configs_dir, load_spec, plan_kv, spec_from_config

BF16, FP32 = 2, 4


def kv(name, dtype="bf16", **kw):
    return plan_kv(load_spec(name), dtype, **kw)


def groups(p):
    return {(g.kind, g.mixer): g for g in p.groups}


# Qwen3-Next-80B-A3B: 48 layers, full_attention_interval 4 -> layers 3, 7, ..., 47 are
# full attention (2 KV heads x 256), the other 36 Gated DeltaNet with 16 key heads and
# 32 value heads of 128, conv kernel 4.
QN_KV_LAYER = 2 * 256 * 2                     # K and V, elements per token and layer
QN_RECURRENT = 32 * 128 * 128                 # num_v_heads x head_k_dim x head_v_dim
QN_CONV = (16 * 128 * 2 + 32 * 128) * (4 - 1)  # conv_dim = key_dim*2 + value_dim, K-1 columns


def test_qwen3_next_only_every_4th_layer_grows_per_token():
    p = kv("qwen3-next-80b-a3b", tokens=1000)
    assert p.per_token == 12 * QN_KV_LAYER * BF16 == 24_576
    assert p.per_token != 48 * QN_KV_LAYER * BF16  # 98,304: every layer as full attention
    assert p.state_per_request == 36 * (QN_RECURRENT + QN_CONV) * BF16 == 39_518_208
    assert p.per_request == 24_576 * 1000 + 39_518_208
    g = groups(p)
    assert (g["full", ""].count, g["full", ""].layers) == (12, "3-47 step 4")
    linear = g["linear", "Gated DeltaNet"]
    assert linear.count == 36 and linear.indices == tuple(i for i in range(48) if i % 4 != 3)
    assert linear.recurrent_bytes == 36 * QN_RECURRENT * BF16
    assert linear.conv_bytes == 36 * QN_CONV * BF16
    assert p.token_bytes_by_kind() == {"linear": 0, "full": 24_576}
    assert p.state_bytes_by_kind() == {"linear": 39_518_208}


def test_qwen3_next_state_dtype_applies_to_the_recurrent_state_only():
    p = kv("qwen3-next-80b-a3b", tokens=1000, state_dtype="fp32")
    assert (p.state_dtype, p.state_dtype_source) == ("fp32", "--state-dtype")
    assert p.state_per_request == 36 * (QN_RECURRENT * FP32 + QN_CONV * BF16)
    assert p.per_token == 24_576  # the KV pages do not change
    assert kv("qwen3-next-80b-a3b").state_dtype_source == "KV dtype"


def test_qwen3_next_tp_splits_value_heads_and_replicates_the_two_kv_heads():
    p = kv("qwen3-next-80b-a3b", tokens=1000, tp=4)
    assert p.per_token_rank == 12 * 1 * 256 * 2 * BF16   # ceil(2/4) = 1 KV head per rank
    assert p.per_request_rank == (p.per_token_rank * 1000
                                  + 36 * (QN_RECURRENT + QN_CONV) // 4 * BF16)


def test_kimi_linear_state_split_and_dtype():
    # KDA (transformers KimiLinearDeltaAttention): 32 heads of 128: state 32 x 128 x 128;
    # q, k, v convolved separately: 3 x 32 x 128 channels x (4 - 1)
    p = kv("kimi-linear-48b-a3b", state_dtype="fp32")
    kda = groups(p)["linear", "KDA"]
    assert kda.recurrent_bytes == 20 * 32 * 128 * 128 * FP32
    assert kda.conv_bytes == 20 * 3 * 32 * 128 * 3 * BF16
    assert p.per_token == 7 * (512 + 64) * BF16


def test_gpt_oss_alternates_window_128_and_full():
    p = kv("gpt-oss-20b", tokens=8192)
    per_layer = 8 * 64 * 2 * BF16  # 8 KV heads of 64, K and V
    assert p.per_token == 24 * per_layer == 49_152
    assert p.per_request == 12 * per_layer * 8192 + 12 * per_layer * 128
    sliding = groups(p)["sliding", ""]
    assert (sliding.count, sliding.layers, sliding.window) == (12, "0-22 step 2", 128)
    assert sliding.token_bytes == 12 * per_layer
    assert sliding.window_cap_bytes == 12 * per_layer * 128 == 3_145_728
    assert groups(p)["full", ""].layers == "1-23 step 2"
    assert kv("gpt-oss-20b", tokens=100).per_request == 24 * per_layer * 100  # under the window


def test_gemma3_27b_is_five_sliding_to_one_global_without_a_pattern_field():
    # the published text_config has sliding_window 1024 and no sliding_window_pattern:
    # Gemma3TextConfig's default 6 applies (layer i global when (i + 1) % 6 == 0)
    assert "sliding_window_pattern" not in json.loads(
        (configs_dir() / "gemma-3-27b-it.json").read_text())["text_config"]
    p = kv("gemma-3-27b-it", tokens=8192)
    per_layer = 16 * 128 * 2 * BF16
    assert p.model == "google/gemma-3-27b-it"
    assert p.per_token == 62 * per_layer == 507_904
    assert p.per_request == 10 * per_layer * 8192 + 52 * per_layer * 1024
    g = groups(p)
    assert (g["full", ""].count, g["full", ""].layers) == (10, "5-59 step 6")
    assert g["sliding", ""].count == 52 and g["sliding", ""].window == 1024


JAMBA = json.loads((configs_dir() / "jamba-v0.1.json").read_text())


def test_jamba_attention_every_8th_layer_rest_mamba1():
    p = kv("jamba-v0.1", tokens=1000)
    d_inner = 2 * 4096                                   # mamba_expand x hidden_size
    state = d_inner * 16 + d_inner * (4 - 1)             # d_inner x d_state + conv (K-1)
    assert p.per_token == 4 * 8 * 128 * 2 * BF16         # layers 4, 12, 20, 28
    assert p.state_per_request == 28 * state * BF16
    g = groups(p)
    assert g["full", ""].layers == "4-28 step 8" and g["mamba", "Mamba-1"].count == 28


NEMOTRON_H = dict(model_type="nemotron_h", num_hidden_layers=7, hidden_size=4096,
                  hybrid_override_pattern="M-M*-ME", num_attention_heads=32,
                  num_key_value_heads=8, head_dim=128, mamba_num_heads=128,
                  mamba_head_dim=64, ssm_state_size=128, n_groups=8, conv_kernel=4,
                  expand=2, mamba_ssm_cache_dtype="float32", intermediate_size=21504,
                  mlp_hidden_act="relu2", n_routed_experts=8, num_experts_per_tok=2,
                  moe_intermediate_size=7688, vocab_size=131072)


def test_nemotron_h_pattern_and_fp32_ssm_state_from_the_config():
    p = plan_kv(spec_from_config(NEMOTRON_H), "bf16", tokens=10)
    ssm = 128 * 64 * 128                                 # n_heads x head_dim x d_state
    conv = (128 * 64 + 2 * 8 * 128) * (4 - 1)            # (d_inner + 2 G N) x (K-1)
    assert (p.state_dtype, p.state_dtype_source) == ("float32", "config mamba_ssm_cache_dtype")
    assert p.state_per_request == 3 * (ssm * FP32 + conv * BF16)
    assert p.per_token == 1 * 8 * 128 * 2 * BF16         # the one '*' layer
    g = groups(p)
    assert g["mamba", "Mamba-2"].layers == "0,2,5" and g["full", ""].layers == "3"
    assert (g["ffn", ""].layers, g["ffn", ""].token_bytes, g["ffn", ""].state_bytes) == (
        "1,4,6", 0, 0)


def test_nemotron_h_8b_shipped_config():
    # nvidia/Nemotron-H-8B-Base-8K: 52 blocks, 24 Mamba-2 (128 heads x 64, state 128,
    # 8 groups, conv 4), 4 attention (8 KV heads x 128), 24 MLP
    p = kv("nemotron-h-8b", state_dtype="fp32", tokens=8192)
    ssm = 128 * 64 * 128
    conv = (128 * 64 + 2 * 8 * 128) * (4 - 1)
    assert p.state_per_request == 24 * (ssm * FP32 + conv * BF16) == 102_137_856
    assert p.per_request == 4 * 8 * 128 * 2 * BF16 * 8192 + 102_137_856
    g = groups(p)
    assert (g["full", ""].layers, g["ffn", ""].count, g["mamba", "Mamba-2"].count) == (
        "7-40 step 11", 24, 24)


def test_nemotron_h_mlp_flops_only_on_its_mlp_and_moe_layers():
    spec = spec_from_config(NEMOTRON_H)
    flops = [layer.linear_flops for layer in spec.layers]
    assert flops[1] == flops[4] == 2 * 2 * 4096 * 21504  # relu2: up and down only
    assert flops[6] == 2 * (2 * 4096 * 7688 * 2 + 4096 * 8)  # 2 of 8 experts + router


def test_mamba_models_have_every_layer_recurrent():
    # state-spaces/mamba-130m-hf shape: intermediate 1536, state 16, conv 4
    mamba = dict(model_type="mamba", num_hidden_layers=24, hidden_size=768,
                 intermediate_size=1536, state_size=16, conv_kernel=4, vocab_size=50280)
    p = plan_kv(spec_from_config(mamba), "fp32", tokens=100_000)
    assert p.per_token == 0
    assert p.per_request == 24 * (1536 * 16 + 1536 * 3) * FP32
    mamba2 = dict(model_type="mamba2", num_hidden_layers=2, hidden_size=256, num_heads=8,
                  head_dim=64, state_size=128, n_groups=1, conv_kernel=4, expand=2,
                  vocab_size=1000)
    assert plan_kv(spec_from_config(mamba2), "fp32").state_per_request == 2 * (
        8 * 64 * 128 + (8 * 64 + 2 * 1 * 128) * 3) * FP32


def test_granite_auto_head_size_and_bamba_attention_indices():
    cfg = dict(model_type="bamba", num_hidden_layers=4, hidden_size=512, attn_layer_indices=[2],
               num_attention_heads=8, num_key_value_heads=2, mamba_n_heads=16,
               mamba_d_head="auto", mamba_expand=2, mamba_d_state=64, mamba_n_groups=1,
               mamba_d_conv=4)
    p = plan_kv(spec_from_config(cfg), "bf16")
    d_head = 2 * 512 // 16  # "auto": expand x hidden / heads
    assert p.state_per_request == 3 * (16 * d_head * 64 + (512 * 2 + 2 * 64) * 3) * BF16
    assert groups(p)["full", ""].layers == "2"


def test_chunked_attention_from_layer_types_is_capped_at_the_chunk():
    base = json.loads((configs_dir() / "llama-3-8b.json").read_text())
    cfg = {**base, "attention_chunk_size": 8192,
           "layer_types": ["chunked_attention"] * 3 * 8 + ["full_attention"] * 8}
    p = plan_kv(spec_from_config(cfg), "bf16", tokens=20_000)
    per_layer = 8 * 128 * 2 * BF16
    assert p.per_request == 24 * per_layer * 8192 + 8 * per_layer * 20_000
    with pytest.raises(UserError, match="attention_chunk_size.*layer_types"):
        spec_from_config({**base, "attention_chunk_size": 8192})


@pytest.mark.parametrize("change, says", [
    ({"layer_types": ["full_attention"] * 47 + ["hybrid"]}, r"'layer_types'.*'hybrid'"),
    ({"hybrid_override_pattern": "M" * 47 + "X", "full_attention_interval": None},
     r"'hybrid_override_pattern'.*'X'"),
    ({"linear_num_value_heads": None, "model_type": "minimax"},
     r"recurrent \(field 'full_attention_interval'\).*'minimax'"),
    ({"mamba_ssm_dtype": "int3"}, r"mamba_ssm_dtype='int3'"),
])
def test_unknown_layer_kinds_and_dtypes_name_the_field_and_value(change, says):
    cfg = {**json.loads((configs_dir() / "qwen3-next-80b-a3b.json").read_text()), **change}
    with pytest.raises(UserError, match=says):
        plan_kv(spec_from_config(cfg), "bf16")


def test_cli_hybrid_text_json_and_one_line_errors(tmp_path, capsys):
    assert main(["plan", "kv", "qwen3-next-80b-a3b", "--tokens", "1000"]) == 0
    out = capsys.readouterr().out
    assert "36 x linear attention (Gated DeltaNet)" in out and "3-47 step 4" in out
    assert "state dtype:  bf16 (from KV dtype)" in out and "39,518,208 B" in out
    assert main(["plan", "kv", "gpt-oss-20b", "--json", "--state-dtype", "fp32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["state_dtype"] == "fp32" and out["groups"][0]["indices"][:2] == [0, 2]
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({**NEMOTRON_H, "hybrid_override_pattern": "M-M*-MQ"}))
    assert main(["plan", "kv", str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "'Q'" in err and "Traceback" not in err


@pytest.mark.parametrize("name, make", [
    ("qwen3-next-80b-a3b", lambda t, c: t.Qwen3NextConfig(**c)),
    ("gpt-oss-20b", lambda t, c: t.GptOssConfig(**c)),
    ("gemma-3-27b-it", lambda t, c: t.Gemma3TextConfig(**c["text_config"])),
    ("jamba", lambda t, c: t.JambaConfig(**c)),
    ("nemotron-h", lambda t, c: t.NemotronHConfig(**c)),
])
def test_layer_kinds_agree_with_transformers_config_classes(name, make):
    """transformers' own config class derives layer_types from the same fields: the
    planner's kinds must match it layer by layer (and a saved config, with the list
    written out, must size the cache the same)."""
    transformers = pytest.importorskip("transformers")
    raw = {"jamba": JAMBA, "nemotron-h": NEMOTRON_H}.get(name) or json.loads(
        (configs_dir() / f"{name}.json").read_text())
    config = make(transformers, raw)
    theirs = {"full_attention": "full", "sliding_attention": "sliding", "mlp": "ffn",
              "moe": "ffn", "linear_attention": "recurrent"}
    ours = [{"linear": "recurrent", "mamba": "recurrent"}.get(layer.kind, layer.kind)
            for layer in spec_from_config(raw).layers]
    assert ours == [theirs[t] for t in config.layer_types]
    saved = config.to_dict()
    assert (plan_kv(spec_from_config(saved), "bf16", tokens=5000).per_request
            == plan_kv(spec_from_config(raw), "bf16", tokens=5000).per_request)


def test_mamba2_groups_replicate_when_fewer_than_tp_ranks():
    # vLLM (mamba_utils.extra_groups_for_head_shards): with n_groups=1 on 4 ranks every
    # rank keeps the whole group's B and C; the heads split 4 ways
    cfg = dict(model_type="mamba2", num_hidden_layers=1, hidden_size=1024, num_heads=32,
               head_dim=64, state_size=128, n_groups=1, conv_kernel=4, expand=2)
    p = plan_kv(spec_from_config(cfg), "bf16", tp=4)
    ssm_rank = 32 // 4 * 64 * 128
    conv_rank = (32 * 64 // 4 + 2 * 1 * 128) * 3
    assert p.per_request_rank == (ssm_rank + conv_rank) * BF16
    assert p.per_request == (32 * 64 * 128 + (32 * 64 + 2 * 128) * 3) * BF16
    p8 = plan_kv(spec_from_config({**cfg, "n_groups": 8}), "bf16", tp=4)  # 2 groups a rank
    assert p8.per_request_rank == (ssm_rank + (32 * 64 // 4 + 2 * 2 * 128) * 3) * BF16
