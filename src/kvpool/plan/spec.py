"""A model's KV-cache shape and prefill work, read from its Hugging Face ``config.json``.

:func:`load_spec` turns the config's own fields into a :class:`ModelSpec`: one
:class:`Layer` per decoder layer saying what that layer keeps per token, what it
keeps per request, and how much prefill work it does. Nothing is guessed: a field
the formula needs and the config lacks raises :class:`~kvpool.errors.UserError`
naming the field. Fields only the prefill FLOPs need (the MLP sizes, ``vocab_size``)
are checked when FLOPs are asked for (:attr:`ModelSpec.flops_error`), so KV sizing
works from a config that lacks them. The sizing (:mod:`kvpool.plan.kv`) and the prefill model
(:mod:`kvpool.plan.prefill`) only read the spec, never the raw config.

Sources of the layer rules, per field:

- ``layer_types`` (transformers >= 4.53 configs; Qwen3-Next, Granite-4.0-H):
  ``full_attention`` / ``attention``, ``sliding_attention``, ``linear_attention``,
  ``mamba``.
- ``linear_attn_config`` (Kimi-Linear checkpoints): ``full_attn_layers`` and
  ``kda_layers`` are 1-based layer numbers (transformers ``KimiLinearConfig``).
- ``model_type == "gemma2"``: the config has no per-layer list; the model code
  alternates sliding (even layers) and global (odd layers) attention
  (transformers ``Gemma2Config.layer_types`` default).
- ``sliding_window_pattern`` (Gemma 3): every ``pattern``-th layer is global, the
  rest slide (transformers ``Gemma3Config``).
- ``use_sliding_window`` (Qwen2): when true, layers ``>= max_window_layers`` slide;
  when false no layer does, whatever ``sliding_window`` says (``Qwen2Config``).
- otherwise a non-null ``sliding_window`` applies to every layer (Mistral-7B-v0.1).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvpool.errors import UserError

FULL, SLIDING, MLA, LINEAR, MAMBA = "full", "sliding", "mla", "linear", "mamba"

# config.json fields that change the KV cache in ways this planner does not model:
# refusing is better than a wrong number.
_UNSUPPORTED = {
    "attention_chunk_size": "chunked local attention (Llama 4)",
    "num_kv_shared_layers": "KV shared between layers (Gemma 3n)",
    "cross_attention_layers": "cross-attention layers (Llama 3.2 Vision)",
}
_LAYER_TYPE_KIND = {
    "full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING,
    "linear_attention": LINEAR, "kda": LINEAR, "mamba": MAMBA,
}


@dataclass(frozen=True)
class Layer:
    """What one decoder layer caches and computes. Element counts are whole-model
    (all heads); :mod:`kvpool.plan.kv` applies dtype, TP and PP.

    - ``token_elems``: elements cached per token (K plus V over all KV heads; the
      MLA latent), capped at ``window`` tokens when ``window`` is set.
    - ``heads``: heads the per-token cache and the state are split over TP ranks
      (a rank holds ``ceil(heads / tp)`` of them); 0 means not split (the MLA latent
      is one vector shared by all heads, so every TP rank holds all of it).
    - ``index_elems``: DeepSeek-V3.2 indexer keys cached per token (one head, never
      split).
    - ``state_elems``: fixed elements per request (linear-attention or SSM state).
    - ``linear_flops``: matmul FLOPs per new token (2 per weight, projections and MLP).
    - ``pair_flops``: FLOPs per (query, key) pair of softmax attention, QKᵀ plus AV.
    - ``pair_cap``: keys each query attends to at most (sliding window, or the
      DeepSeek-V3.2 top-k selection); None = all earlier tokens.
    - ``index_pair_flops``: FLOPs per (query, key) pair of the V3.2 indexer, which
      scores every earlier token.
    """

    index: int
    kind: str
    token_elems: int = 0
    heads: int = 0
    window: int | None = None
    index_elems: int = 0
    state_elems: int = 0
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
    """

    name: str
    layers: tuple[Layer, ...]
    head_flops: int
    flops_error: str = ""


def check_flops(spec: ModelSpec) -> None:
    """Raise UserError (the missing field) unless ``spec`` has complete prefill FLOPs."""
    if spec.flops_error:
        raise UserError(spec.flops_error)


class _Fields:
    """Reads fields from one config dict; a missing or malformed one is a UserError
    naming the field and the file."""

    def __init__(self, cfg: dict[str, Any], source: str):
        self.cfg, self.source = cfg, source

    def has(self, name: str) -> bool:
        return self.cfg.get(name) is not None

    def get(self, name: str, default: Any = None) -> Any:
        value = self.cfg.get(name)
        return default if value is None else value

    def int(self, name: str, why: str, minimum: int = 1) -> int:
        if not self.has(name):
            raise UserError(f"{self.source}: missing field {name!r} (needed for {why})")
        value = self.cfg[name]
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise UserError(f"{self.source}: field {name!r} must be an integer >= {minimum}, "
                            f"got {value!r}")
        return value

    def first_int(self, names: tuple[str, ...], why: str, minimum: int = 1) -> int:
        for name in names:
            if self.has(name):
                return self.int(name, why, minimum)
        raise UserError(f"{self.source}: missing field {names[0]!r} (needed for {why}; "
                        f"also accepted: {', '.join(names[1:])})")


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
        cfg = {**cfg["text_config"], "model_type": cfg["text_config"].get("model_type",
                                                                          cfg.get("model_type"))}
    f = _Fields(cfg, source)
    for name, what in _UNSUPPORTED.items():
        if f.get(name):
            raise UserError(f"{source}: field {name!r} ({what}) is not supported by kvpool plan")
    n_layers = f.int("num_hidden_layers", "the number of layers")
    hidden = f.int("hidden_size", "projection sizes")
    kinds = _layer_kinds(f, n_layers)
    layers = tuple(_layer(f, i, kind, hidden) for i, kind in enumerate(kinds))
    try:  # only the prefill FLOPs need these fields
        mlp = [_mlp_flops(f, i, hidden) for i in range(n_layers)]
        head, error = 2 * hidden * f.int("vocab_size", "the LM head"), ""
    except UserError as exc:
        mlp, head, error = [0] * n_layers, 0, f"{exc}; prefill FLOPs need it, KV sizing does not"
    layers = tuple(replace(layer, linear_flops=layer.linear_flops + m)
                   for layer, m in zip(layers, mlp))
    return ModelSpec(name=str(cfg.get("_name_or_path") or source), layers=layers,
                     head_flops=head, flops_error=error)


def _layer_kinds(f: _Fields, n: int) -> list[str]:
    """One kind per layer, from the first rule in the module docstring that applies."""
    if f.has("layer_types"):
        types = f.get("layer_types")
        if not isinstance(types, list) or len(types) != n:
            raise UserError(f"{f.source}: field 'layer_types' must list {n} layer types "
                            f"(num_hidden_layers)")
        unknown = sorted({t for t in types if t not in _LAYER_TYPE_KIND}, key=str)
        if unknown:
            raise UserError(f"{f.source}: field 'layer_types' has unknown type(s) {unknown}; "
                            f"known: {sorted(_LAYER_TYPE_KIND)}")
        kinds = [_LAYER_TYPE_KIND[t] for t in types]
    elif isinstance(f.get("linear_attn_config"), dict):
        kinds = _kimi_kinds(f, n)
    elif f.get("model_type") == "gemma2":
        kinds = [SLIDING if i % 2 == 0 else FULL for i in range(n)]
    elif f.has("sliding_window_pattern"):
        pattern = f.int("sliding_window_pattern", "the sliding/global interleave")
        kinds = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
    elif "use_sliding_window" in f.cfg:
        start = f.int("max_window_layers", "which layers slide", 0) if f.get(
            "use_sliding_window") else n
        kinds = [SLIDING if i >= start else FULL for i in range(n)]
    else:
        kinds = [SLIDING if f.has("sliding_window") else FULL] * n
    if f.has("kv_lora_rank"):  # MLA replaces every softmax-attention layer's K/V
        kinds = [MLA if k == FULL else k for k in kinds]
    return kinds


def _kimi_kinds(f: _Fields, n: int) -> list[str]:
    lac = f.get("linear_attn_config")
    kinds: list[str | None] = [None] * n
    for field, kind in (("full_attn_layers", FULL), ("kda_layers", LINEAR)):
        for number in lac.get(field) or []:
            if not isinstance(number, int) or not 1 <= number <= n:
                raise UserError(f"{f.source}: linear_attn_config.{field} has {number!r}; "
                                f"layer numbers are 1..{n}")
            kinds[number - 1] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise UserError(f"{f.source}: linear_attn_config lists no type for layer(s) {missing} "
                        "(expected in full_attn_layers or kda_layers)")
    return kinds  # type: ignore[return-value]


def _layer(f: _Fields, i: int, kind: str, hidden: int) -> Layer:
    if kind in (FULL, SLIDING):
        attn = _softmax_attention(f, i, kind, hidden)
    elif kind == MLA:
        attn = _mla(f, i, hidden)
    elif kind == LINEAR:
        attn = _linear_attention(f, i, hidden)
    else:
        attn = _mamba(f, i, hidden)
    return Layer(**attn)  # the MLP's FLOPs are added by spec_from_config


def _softmax_attention(f: _Fields, i: int, kind: str, hidden: int) -> dict:
    """MHA / GQA / MQA: K and V of ``num_key_value_heads`` heads of ``head_dim`` per
    token (Vaswani et al. 2017; GQA, Ainslie et al. 2023; MQA, Shazeer 2019)."""
    q_heads = f.int("num_attention_heads", "attention heads")
    kv_heads = f.int("num_key_value_heads",
                     "KV heads; for multi-head attention it equals num_attention_heads")
    head_dim = f.int("head_dim", "head size") if f.has("head_dim") else _div(
        f, hidden, q_heads, "head_dim = hidden_size / num_attention_heads")
    window = f.int("sliding_window", "sliding-window layers") if kind == SLIDING else None
    proj = hidden * head_dim * (2 * q_heads + 2 * kv_heads)  # q, k, v, o
    return dict(index=i, kind=kind, token_elems=2 * kv_heads * head_dim, heads=kv_heads,
                window=window, linear_flops=2 * proj,
                pair_flops=2 * q_heads * 2 * head_dim, pair_cap=window)


def _mla(f: _Fields, i: int, hidden: int) -> dict:
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


def _linear_attention(f: _Fields, i: int, hidden: int) -> dict:
    """Gated delta-rule linear attention: per head a ``d_k × d_v`` recurrent state plus
    the last ``K−1`` inputs of the short causal convolution over q, k and v (the ``K−1``
    a width-K causal convolution needs; vLLM's layout). Kimi Delta Attention
    (arXiv:2510.26692) from ``linear_attn_config`` {num_heads, head_dim,
    short_conv_kernel_size} (or transformers' ``linear_num_heads``, ``linear_head_dim``,
    ``linear_conv_kernel_dim``) with d_k = d_v = head_dim; Gated DeltaNet as in Qwen3-Next
    from ``linear_num_{key,value}_heads``, ``linear_{key,value}_head_dim`` and
    ``linear_conv_kernel_dim``. Prefill FLOPs per token: projections plus ≈ 6·d_k·d_v
    per value head for the state read, update and readout.
    """
    lac = f.get("linear_attn_config")
    if isinstance(lac, dict) or f.has("linear_num_heads"):
        # Kimi checkpoint names, or the names transformers' KimiLinearConfig saves
        sub, names = ((_Fields(lac, f"{f.source}: linear_attn_config"),
                       ("num_heads", "head_dim", "short_conv_kernel_size"))
                      if isinstance(lac, dict) else
                      (f, ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")))
        nv = nk = sub.int(names[0], "linear-attention heads")
        dk = dv = sub.int(names[1], "the linear-attention state")
        conv = sub.int(names[2], "the short-convolution state")
        # q, k, v, o; then the forget and output gates (low rank through head_dim), beta
        proj = hidden * nk * dk * 4 + 2 * hidden * dk + 2 * dk * nk * dk + hidden * nk
    else:
        nk = f.int("linear_num_key_heads", "linear-attention key heads")
        nv = f.int("linear_num_value_heads", "linear-attention value heads")
        dk = f.int("linear_key_head_dim", "the linear-attention state")
        dv = f.int("linear_value_head_dim", "the linear-attention state")
        conv = f.int("linear_conv_kernel_dim", "the short-convolution state")
        proj = hidden * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * hidden
    state = nv * dk * dv + (2 * nk * dk + nv * dv) * (conv - 1)
    return dict(index=i, kind=LINEAR, heads=nv, state_elems=state,
                linear_flops=2 * proj + 6 * nv * dk * dv)


def _mamba(f: _Fields, i: int, hidden: int) -> dict:
    """Mamba-2 layer (Dao & Gu 2024, arXiv:2405.21060): SSM state of ``n_heads ×
    head_dim × d_state`` plus the last ``d_conv−1`` inputs of the convolution over
    x, B and C (``d_inner + 2·n_groups·d_state`` channels); Granite-4.0-H field names."""
    heads = f.int("mamba_n_heads", "Mamba heads")
    d_head = f.int("mamba_d_head", "Mamba head size")
    d_state = f.int("mamba_d_state", "the SSM state")
    groups = f.int("mamba_n_groups", "the SSM B/C groups")
    d_conv = f.int("mamba_d_conv", "the convolution state")
    inner = heads * d_head
    state = heads * d_head * d_state + (inner + 2 * groups * d_state) * (d_conv - 1)
    proj = hidden * (2 * inner + 2 * groups * d_state + heads) + inner * hidden
    return dict(index=i, kind=MAMBA, heads=heads, state_elems=state,
                linear_flops=2 * proj + 6 * heads * d_head * d_state)


def _mlp_flops(f: _Fields, i: int, hidden: int) -> int:
    """Gated MLP (gate, up, down: 3 · hidden · intermediate weights) or, on MoE layers,
    the ``num_experts_per_tok`` routed plus the shared experts and the router. MoE
    layers are those from ``first_k_dense_replace`` on (DeepSeek-V3 config)."""
    experts = f.get("n_routed_experts") or f.get("num_experts") or f.get("num_local_experts")
    if experts and i >= f.get("first_k_dense_replace", 0):
        topk = f.first_int(("num_experts_per_tok", "num_experts_per_token"), "routed experts")
        inter = f.int("moe_intermediate_size", "expert size")
        shared = f.get("n_shared_experts") or f.get("num_shared_experts") or 0
        return 2 * (3 * hidden * inter * (topk + shared) + hidden * experts)
    return 2 * 3 * hidden * f.int("intermediate_size", "the MLP")


def _div(f: _Fields, a: int, b: int, what: str) -> int:
    if a % b:
        raise UserError(f"{f.source}: {what} is not an integer ({a}/{b}); add a 'head_dim' field")
    return a // b
