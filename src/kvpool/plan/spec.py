"""A model's KV-cache shape and prefill work, read from its Hugging Face ``config.json``.

:func:`load_spec` turns the config's own fields into a :class:`ModelSpec`: one
:class:`Layer` per decoder layer saying what that layer keeps per token, what it
keeps per request, and how much prefill work it does. Nothing is guessed: a field
the formula needs and the config lacks raises :class:`~kvpool.errors.UserError`
naming the field. Fields only the prefill FLOPs need (the MLP sizes, ``vocab_size``)
are checked when FLOPs are asked for (:attr:`ModelSpec.flops_error`), so KV sizing
works from a config that lacks them. The sizing (:mod:`kvpool.plan.kv`) and the prefill model
(:mod:`kvpool.plan.prefill`) only read the spec, never the raw config.

Which layer is which comes from :mod:`kvpool.plan.layout` (``layer_types``,
``full_attention_interval``, Kimi's ``linear_attn_config``, Jamba's
``attn_layer_period``, Nemotron-H's ``hybrid_override_pattern``, Gemma's sliding
pattern, ...); the state of a recurrent layer from :mod:`kvpool.plan.recurrent`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpool.errors import UserError
from kvpool.plan.fields import Fields
from kvpool.plan.layout import CHUNKED, FFN, FULL, RECURRENT, SLIDING, layer_layout
from kvpool.plan.recurrent import LINEAR, MAMBA, recurrent_layer

MLA = "mla"
KINDS = (FULL, SLIDING, CHUNKED, MLA, LINEAR, MAMBA, FFN)

# config.json fields that change the KV cache in ways this planner does not model:
# refusing is better than a wrong number.
_UNSUPPORTED = {
    "num_kv_shared_layers": "KV shared between layers (Gemma 3n)",
    "cross_attention_layers": "cross-attention layers (Llama 3.2 Vision)",
}
# fields naming the dtype a serving engine keeps the SSM / recurrent state in
# (NemotronHConfig.mamba_ssm_cache_dtype; SGLang reads config.mamba_ssm_dtype)
STATE_DTYPE_FIELDS = ("mamba_ssm_cache_dtype", "mamba_ssm_dtype")
# model types whose layers are mixer-only (no MLP): Mamba-1/2 blocks
_NO_MLP_TYPES = ("mamba", "mamba2", "falcon_mamba")
# gated attention: q_proj also yields an output gate, 2 · heads · head_dim outputs
# (transformers models/qwen3_next/modeling_qwen3_next.py Qwen3NextAttention; Qwen3.5)
_GATED_QUERY_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


@dataclass(frozen=True)
class Layer:
    """What one decoder layer caches and computes. Element counts are whole-model
    (all heads); :mod:`kvpool.plan.kv` applies dtype, TP and PP.

    - ``kind``: one of :data:`KINDS`: ``full`` / ``sliding`` / ``chunked`` softmax
      attention, ``mla`` latent, ``linear`` (Gated DeltaNet, KDA) or ``mamba``
      (Mamba-1/2) recurrent state, ``ffn`` (MLP/MoE only, no cache).
    - ``mixer``: the recurrent layer's name (``"Gated DeltaNet"``, ``"KDA"``,
      ``"Mamba-2"``, ``"Mamba-1"``); "" for the others.
    - ``token_elems``: elements cached per token (K plus V over all KV heads; the
      MLA latent), capped at ``window`` tokens when ``window`` is set (the sliding
      window, or the attention chunk).
    - ``heads``: heads the per-token cache and the state are split over TP ranks
      (a rank holds ``ceil(heads / tp)`` of them); 0 means not split (the MLA latent
      is one vector shared by all heads, so every TP rank holds all of it).
    - ``index_elems``: DeepSeek-V3.2 indexer keys cached per token (one head, never
      split).
    - ``state_elems``: fixed recurrent state per request (the delta-rule matrices or
      the SSM state), kept at the state dtype.
    - ``conv_elems``: fixed short-convolution state per request (last ``K−1``
      inputs), kept at the KV dtype. Of it, ``conv_groups × conv_group_elems`` are the
      Mamba-2 B/C group channels, which TP splits by group, not by head (a rank holds
      ``ceil(groups / tp)`` groups: vLLM replicates groups when ``n_groups < tp``).
    - ``linear_flops``: matmul FLOPs per new token (2 per weight, projections and MLP).
    - ``pair_flops``: FLOPs per (query, key) pair of softmax attention, QKᵀ plus AV.
    - ``pair_cap``: keys each query attends to at most (sliding window, chunk, or the
      DeepSeek-V3.2 top-k selection); None = all earlier tokens.
    - ``index_pair_flops``: FLOPs per (query, key) pair of the V3.2 indexer, which
      scores every earlier token.
    """

    index: int
    kind: str
    mixer: str = ""
    token_elems: int = 0
    heads: int = 0
    window: int | None = None
    index_elems: int = 0
    state_elems: int = 0
    conv_elems: int = 0
    conv_groups: int = 0
    conv_group_elems: int = 0
    linear_flops: int = 0
    pair_flops: int = 0
    pair_cap: int | None = None
    index_pair_flops: int = 0


@dataclass(frozen=True)
class ModelSpec:
    """A model's layers plus the per-request logits cost (``head_flops``: the LM head
    on the last prompt token, 2 · hidden · vocab).

    ``flops_error``: "" when the FLOP fields are complete; otherwise the message naming
    the missing or malformed field, and ``linear_flops`` / ``head_flops`` lack the MLP
    and LM head (:func:`check_flops` raises it; KV sizing does not need them).
    ``state_dtype`` / ``state_dtype_field``: the recurrent-state dtype the config names
    and the field naming it (one of :data:`STATE_DTYPE_FIELDS`), or None / "".
    ``layout_field``: the config field that said which layer is which.
    ``attention_heads``: the config's ``num_attention_heads`` (query heads), 0 when it
    has none (a pure Mamba model); TP must divide it.
    """

    name: str
    layers: tuple[Layer, ...]
    head_flops: int
    flops_error: str = ""
    state_dtype: str | None = None
    state_dtype_field: str = ""
    layout_field: str = ""
    attention_heads: int = 0


def check_flops(spec: ModelSpec) -> None:
    """Raise UserError (the missing field) unless ``spec`` has complete prefill FLOPs."""
    if spec.flops_error:
        raise UserError(spec.flops_error)


def load_spec(path: str | Path) -> ModelSpec:
    """Read ``config.json`` at ``path`` (or the name of a shipped config, see
    :func:`kvpool.plan.configs_dir`) and return its :class:`ModelSpec`.

    Raises: UserError when the file is missing or unreadable, is not UTF-8 JSON, is not
    a JSON object, or lacks a field the KV shape needs.
    """
    p = _resolve(path)
    try:
        cfg = json.loads(p.read_bytes().decode("utf-8"))
    except OSError as exc:
        raise UserError(f"cannot read config {str(path)!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not a UTF-8 text file (byte {exc.start}: {exc.reason}); "
                        "expected a config.json") from None
    except json.JSONDecodeError as exc:
        raise UserError(f"{p}: not valid JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise UserError(f"{p}: JSON nested too deeply") from None
    if not isinstance(cfg, dict):
        raise UserError(f"{p}: expected a JSON object ({{...}}), got a {type(cfg).__name__}")
    return spec_from_config(cfg, source=p.name)


def configs_dir() -> Path:
    """Folder of the configs shipped with kvpool (``kvpool/plan/configs``)."""
    return Path(__file__).with_name("configs")


def _resolve(path: str | Path) -> Path:
    p = Path(path)
    shipped = configs_dir() / f"{p.name}.json"
    return shipped if not p.exists() and shipped.exists() else p


def spec_from_config(cfg: dict[str, Any], source: str = "config.json") -> ModelSpec:
    """Build a :class:`ModelSpec` from a parsed ``config.json`` dict.

    A multimodal config's ``text_config`` is used when present.
    Raises: UserError naming the first missing, malformed or unsupported field of the
    KV shape; a FLOP-only field is reported in ``flops_error`` instead.
    """
    if isinstance(cfg.get("text_config"), dict):
        text = cfg["text_config"]
        cfg = {"_name_or_path": cfg.get("_name_or_path"), **text,
               "model_type": text.get("model_type", cfg.get("model_type"))}
    f = Fields(cfg, source)
    for name, what in _UNSUPPORTED.items():
        if f.get(name):
            raise UserError(f"{source}: field {name!r} ({what}) is not supported by kvpool plan")
    n_layers = _layer_count(f)
    hidden = f.int("hidden_size", "projection sizes")
    tokens, layout_field = layer_layout(f, n_layers)
    layers = tuple(_layer(f, i, token, hidden, layout_field) for i, token in enumerate(tokens))
    try:  # only the prefill FLOPs need these fields
        mlp = _mlp_per_layer(f, tokens, hidden)
        head, error = 2 * hidden * f.int("vocab_size", "the LM head"), ""
    except UserError as exc:
        mlp, head, error = [0] * n_layers, 0, f"{exc}; prefill FLOPs need it, KV sizing does not"
    layers = tuple(replace(layer, linear_flops=layer.linear_flops + m)
                   for layer, m in zip(layers, mlp))
    dtype_field = next((name for name in STATE_DTYPE_FIELDS if f.has(name)), "")
    q_heads = (f.int("num_attention_heads", "attention heads")
               if f.has("num_attention_heads") else 0)
    return ModelSpec(name=str(cfg.get("_name_or_path") or source), layers=layers,
                     head_flops=head, flops_error=error,
                     state_dtype=str(f.get(dtype_field)) if dtype_field else None,
                     state_dtype_field=dtype_field, layout_field=layout_field,
                     attention_heads=q_heads)


def _layer_count(f: Fields) -> int:
    """``num_hidden_layers``; a Nemotron-H config may leave it out (``NemotronHConfig``
    derives it from the length of its layer list or pattern)."""
    if not f.has("num_hidden_layers"):
        for name in ("layers_block_type", "hybrid_override_pattern"):
            if isinstance(f.get(name), (list, str)) and f.get(name):
                return len(f.get(name))
    return f.int("num_hidden_layers", "the number of layers")


def _layer(f: Fields, i: int, token: str, hidden: int, layout_field: str) -> Layer:
    if token == RECURRENT:
        return Layer(**recurrent_layer(f, i, hidden, layout_field))
    if token == FFN:
        return Layer(index=i, kind=FFN)  # its MLP FLOPs are added by spec_from_config
    if token == FULL and f.has("kv_lora_rank"):  # MLA replaces softmax K/V
        return Layer(**_mla(f, i, hidden))
    return Layer(**_softmax_attention(f, i, token, hidden))


def _softmax_attention(f: Fields, i: int, kind: str, hidden: int) -> dict:
    """MHA / GQA / MQA: K and V of ``num_key_value_heads`` heads of ``head_dim`` per
    token (Vaswani et al. 2017; GQA, Ainslie et al. 2023; MQA, Shazeer 2019). A sliding
    layer keeps the last ``sliding_window`` tokens; a chunked one (Llama 4) at most the
    ``attention_chunk_size`` tokens of the current chunk."""
    q_heads = f.int("num_attention_heads", "attention heads")
    kv_heads = f.int("num_key_value_heads",
                     "KV heads; for multi-head attention it equals num_attention_heads")
    named = next((n for n in ("head_dim", "attention_head_dim") if f.has(n)), "")
    head_dim = f.int(named, "head size") if named else _div(  # Nemotron-H: attention_head_dim
        f, hidden, q_heads, "head_dim = hidden_size / num_attention_heads")
    window = (f.int("sliding_window", "sliding-window layers") if kind == SLIDING else
              f.int("attention_chunk_size", "chunked-attention layers") if kind == CHUNKED
              else None)
    q_out = 2 if f.get("model_type") in _GATED_QUERY_TYPES else 1
    proj = hidden * head_dim * ((q_out + 1) * q_heads + 2 * kv_heads)  # q (+ gate), k, v, o
    return dict(index=i, kind=kind, token_elems=2 * kv_heads * head_dim, heads=kv_heads,
                window=window, linear_flops=2 * proj,
                pair_flops=2 * q_heads * 2 * head_dim, pair_cap=window)


def _mla(f: Fields, i: int, hidden: int) -> dict:
    """Multi-head latent attention (DeepSeek-V2, arXiv:2405.04434, §2.1.2; V3): the
    cache holds one compressed latent of ``kv_lora_rank`` plus the decoupled RoPE key
    of ``qk_rope_head_dim`` per token, shared by all heads, so TP ranks replicate it.
    FLOPs use the explicit (non-absorbed) form: heads of ``qk_nope + qk_rope`` for QKᵀ
    and ``v_head_dim`` for AV. With ``index_head_dim`` (DeepSeek-V3.2 sparse attention)
    an indexer key of that size is cached per token too, the indexer scores every
    earlier token with ``index_n_heads`` heads, and attention keeps ``index_topk`` keys.
    """
    heads = f.int("num_attention_heads", "attention heads")
    rank = f.int("kv_lora_rank", "the MLA latent")
    rope = f.int("qk_rope_head_dim", "the MLA decoupled RoPE key")
    nope = f.int("qk_nope_head_dim", "MLA query/key heads")
    v_dim = f.int("v_head_dim", "MLA value heads")
    q_rank = f.get("q_lora_rank")
    q_proj = (hidden * q_rank + q_rank * heads * (nope + rope) if q_rank
              else hidden * heads * (nope + rope))
    proj = q_proj + hidden * (rank + rope) + rank * heads * (nope + v_dim) + heads * v_dim * hidden
    out = dict(index=i, kind=MLA, token_elems=rank + rope, heads=0, linear_flops=2 * proj,
               pair_flops=2 * heads * (nope + rope + v_dim))
    if f.has("index_head_dim"):
        idx_dim = f.int("index_head_dim", "the sparse-attention indexer keys")
        idx_heads = f.int("index_n_heads", "the sparse-attention indexer")
        topk = f.int("index_topk", "the keys sparse attention keeps")
        out.update(index_elems=idx_dim, pair_cap=topk, index_pair_flops=2 * idx_heads * idx_dim,
                   linear_flops=out["linear_flops"] + 2 * hidden * (idx_heads * idx_dim + idx_dim))
    return out


def _mlp_per_layer(f: Fields, tokens: list[str], hidden: int) -> list[int]:
    """MLP FLOPs per layer. With MLP/MoE-only layers in the layout (Nemotron-H) those
    layers carry the MLP and the mixer layers none; Mamba-1/2 models have no MLP."""
    if f.get("model_type") in _NO_MLP_TYPES:
        return [0] * len(tokens)
    if FFN not in tokens:
        return [_mlp_flops(f, i, hidden) for i in range(len(tokens))]
    kinds = f.get("layer_types") or f.get("layers_block_type") or [
        {"-": "mlp", "E": "moe"}.get(c, "") for c in f.get("hybrid_override_pattern")]
    return [_mlp_flops(f, i, hidden, moe=kind == "moe") if kind in ("mlp", "moe") else 0
            for i, kind in enumerate(kinds)]


def _mlp_flops(f: Fields, i: int, hidden: int, moe: bool | None = None) -> int:
    """MLP FLOPs per token: a gated MLP (gate, up, down: 3 · hidden · intermediate
    weights; 2 matrices for Nemotron-H's ungated ``relu2``) or, on MoE layers, the
    ``num_experts_per_tok`` routed plus the shared experts and the router. MoE layers
    are those from ``first_k_dense_replace`` on (DeepSeek-V3), or ``i % expert_layer_period
    == expert_layer_offset`` (Jamba); an expert is ``moe_intermediate_size`` wide, else
    ``intermediate_size`` (Mixtral, gpt-oss); Qwen3-Next adds one shared expert of
    ``shared_expert_intermediate_size``. ``moe`` forces the choice (Nemotron-H's E / -)."""
    mats = 2 if f.get("mlp_hidden_act") == "relu2" else 3
    experts = f.get("n_routed_experts") or f.get("num_experts") or f.get("num_local_experts")
    if moe is None:
        moe = bool(experts) and i >= f.get("first_k_dense_replace", 0) and (
            not f.has("expert_layer_period")
            or i % f.get("expert_layer_period") == f.get("expert_layer_offset", 0))
    if not moe:
        return 2 * mats * hidden * f.int("intermediate_size", "the MLP")
    if not experts:
        raise f.error("missing field 'n_routed_experts' (needed for MoE layers; also accepted: "
                      "num_experts, num_local_experts)")
    topk = f.first_int(("num_experts_per_tok", "num_experts_per_token", "experts_per_token"),
                       "routed experts")
    inter = f.first_int(("moe_intermediate_size", "intermediate_size"), "expert size")
    shared = (f.get("n_shared_experts") or f.get("num_shared_experts") or 0) * inter
    shared += f.get("shared_expert_intermediate_size") or f.get(
        "moe_shared_expert_intermediate_size") or 0
    return 2 * (mats * hidden * (inter * topk + shared) + hidden * experts)


def _div(f: Fields, a: int, b: int, what: str) -> int:
    if a % b:
        raise UserError(f"{f.source}: {what} is not an integer ({a}/{b}); add a 'head_dim' field")
    return a // b
