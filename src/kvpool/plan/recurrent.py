"""Per-request state of a recurrent layer (linear attention, SSM), from ``config.json``.

A recurrent layer keeps no per-token cache: it keeps a fixed recurrent state (the
delta-rule matrix or the SSM state) plus the last ``K − 1`` inputs of its short causal
convolution (what a width-``K`` convolution needs for the next token; the layout vLLM
and SGLang allocate; transformers' own cache keeps ``K`` columns). Which formula a
layer uses is read from the fields the config has, never guessed:

- Kimi Delta Attention (``linear_attn_config`` or ``linear_num_heads``; transformers
  ``models/kimi_linear/modeling_kimi_linear.py``, ``KimiLinearDeltaAttention``):
  ``H`` heads of ``d`` = ``head_dim``; state ``H·d·d``; q, k and v each convolved:
  conv ``3·H·d·(K−1)``.
- Gated DeltaNet (``linear_num_value_heads``; ``models/qwen3_next/modeling_qwen3_next.py``,
  ``Qwen3NextGatedDeltaNet``): state ``H_v·d_k·d_v``; conv over q, k, v:
  ``conv_dim = 2·H_k·d_k + H_v·d_v`` channels, ``conv_dim·(K−1)``.
- Mamba-2 (``mamba_n_heads`` Granite-4.0-H/Bamba, ``mamba_num_heads`` Nemotron-H,
  ``model_type: mamba2``; ``models/mamba2/modeling_mamba2.py``,
  ``models/nemotron_h/modeling_nemotron_h.py``): SSM ``H·d_head·N``; conv over x, B, C:
  ``(d_inner + 2·G·N)·(K−1)`` with ``d_inner = H·d_head``.
- Mamba-1 (``model_type`` ``jamba``, ``mamba``, ``falcon_mamba``;
  ``models/jamba/modeling_jamba.py``, ``models/mamba/modeling_mamba.py``): SSM
  ``d_inner·N``, conv ``d_inner·(K−1)``, ``d_inner = intermediate_size`` (Mamba) or
  ``mamba_expand·hidden_size`` (Jamba).

Prefill FLOPs per token: the projections (2 per weight) plus ≈ 6 per state element
for the state read, update and readout.
"""

from __future__ import annotations

import math

from kvpool.plan.fields import Fields

LINEAR, MAMBA = "linear", "mamba"
_MAMBA1_TYPES = ("jamba", "mamba", "falcon_mamba")

# Mamba-2 field spellings per family: heads, head size, state size, groups, conv width,
# expand (for a head size of "auto": expand · hidden / heads)
_MAMBA2_NAMES = {
    "mamba_n_heads": ("mamba_n_heads", "mamba_d_head", "mamba_d_state", "mamba_n_groups",
                      "mamba_d_conv", "mamba_expand"),
    "mamba_num_heads": ("mamba_num_heads", "mamba_head_dim", "ssm_state_size", "n_groups",
                        "conv_kernel", "expand"),
    "num_heads": ("num_heads", "head_dim", "state_size", "n_groups", "conv_kernel", "expand"),
}


def recurrent_layer(f: Fields, i: int, hidden: int, field: str) -> dict:
    """The :class:`~kvpool.plan.spec.Layer` fields of recurrent layer ``i`` (``kind``,
    ``mixer``, ``heads``, ``state_elems``, ``conv_elems``, ``linear_flops``).

    ``field`` names the layout field that made it recurrent, for the error raised
    (UserError) when the config has the fields of no known recurrent layer."""
    if isinstance(f.get("linear_attn_config"), dict) or f.has("linear_num_heads"):
        return _kda(f, i, hidden)
    if f.has("linear_num_value_heads"):
        return _gated_deltanet(f, i, hidden)
    for heads_field in ("mamba_n_heads", "mamba_num_heads"):
        if f.has(heads_field):
            return _mamba2(f, i, hidden, _MAMBA2_NAMES[heads_field])
    if f.get("model_type") == "mamba2":
        return _mamba2(f, i, hidden, _MAMBA2_NAMES["num_heads"])
    if f.get("model_type") in _MAMBA1_TYPES:
        return _mamba1(f, i, hidden)
    raise f.error(
        f"layer {i} is recurrent (field {field!r}) but the config has the fields of no "
        "known recurrent layer: linear_attn_config (KDA), linear_num_value_heads (Gated "
        "DeltaNet), mamba_n_heads / mamba_num_heads (Mamba-2), or model_type "
        f"mamba2 / {' / '.join(_MAMBA1_TYPES)}; model_type is {f.get('model_type')!r}")


def _kda(f: Fields, i: int, hidden: int) -> dict:
    lac = f.get("linear_attn_config")
    sub, names = ((Fields(lac, f"{f.source}: linear_attn_config"),
                   ("num_heads", "head_dim", "short_conv_kernel_size"))
                  if isinstance(lac, dict) else  # the names transformers' config saves
                  (f, ("linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim")))
    heads = sub.int(names[0], "linear-attention heads")
    d = sub.int(names[1], "the linear-attention state")
    conv = sub.int(names[2], "the short-convolution state")
    # q, k, v, o; the forget and output gates (low rank through head_dim); beta
    proj = hidden * heads * d * 4 + 2 * hidden * d + 2 * d * heads * d + hidden * heads
    return dict(index=i, kind=LINEAR, mixer="KDA", heads=heads, state_elems=heads * d * d,
                conv_elems=3 * heads * d * (conv - 1),
                linear_flops=2 * proj + 6 * heads * d * d)


def _gated_deltanet(f: Fields, i: int, hidden: int) -> dict:
    nk = f.int("linear_num_key_heads", "linear-attention key heads")
    nv = f.int("linear_num_value_heads", "linear-attention value heads")
    dk = f.int("linear_key_head_dim", "the linear-attention state")
    dv = f.int("linear_value_head_dim", "the linear-attention state")
    conv = f.int("linear_conv_kernel_dim", "the short-convolution state")
    # in_proj_qkvz (q, k, v and the output gate z), in_proj_ba (beta, decay), out_proj
    proj = hidden * (2 * nk * dk + 2 * nv * dv + 2 * nv) + nv * dv * hidden
    return dict(index=i, kind=LINEAR, mixer="Gated DeltaNet", heads=nv,
                state_elems=nv * dk * dv, conv_elems=(2 * nk * dk + nv * dv) * (conv - 1),
                linear_flops=2 * proj + 6 * nv * dk * dv)


def _mamba2(f: Fields, i: int, hidden: int, names: tuple[str, ...]) -> dict:
    heads_n, head_n, state_n, groups_n, conv_n, expand_n = names
    heads = f.int(heads_n, "Mamba heads")
    if f.get(head_n) == "auto":  # Granite-4.0-H / Bamba: d_inner split over the heads
        d_head = f.int(expand_n, "the Mamba head size (head size 'auto')") * hidden // heads
    else:
        d_head = f.int(head_n, "Mamba head size")
    d_state = f.int(state_n, "the SSM state")
    groups = f.int(groups_n, "the SSM B/C groups")
    d_conv = f.int(conv_n, "the convolution state")
    inner = heads * d_head
    proj = hidden * (2 * inner + 2 * groups * d_state + heads) + inner * hidden
    return dict(index=i, kind=MAMBA, mixer="Mamba-2", heads=heads,
                state_elems=heads * d_head * d_state,
                conv_elems=(inner + 2 * groups * d_state) * (d_conv - 1), conv_groups=groups,
                conv_group_elems=2 * d_state * (d_conv - 1),
                linear_flops=2 * proj + 6 * heads * d_head * d_state)


def _mamba1(f: Fields, i: int, hidden: int) -> dict:
    if f.get("model_type") == "jamba":
        inner = f.int("mamba_expand", "the Mamba inner size") * hidden
        d_state = f.int("mamba_d_state", "the SSM state")
        d_conv = f.int("mamba_d_conv", "the convolution state")
        rank = f.get("mamba_dt_rank", "auto")
    else:
        inner = (f.int("intermediate_size", "the Mamba inner size") if f.has("intermediate_size")
                 else f.int("expand", "the Mamba inner size") * hidden)
        d_state = f.int("state_size", "the SSM state")
        d_conv = f.int("conv_kernel", "the convolution state")
        rank = f.get("time_step_rank", "auto")
    rank = math.ceil(hidden / 16) if rank == "auto" else rank  # both configs' "auto" rule
    # in_proj (x and gate), x_proj (dt, B, C), dt_proj, out_proj
    proj = hidden * 2 * inner + inner * (rank + 2 * d_state) + rank * inner + inner * hidden
    # channels, not heads, are what TP splits: d_inner is the split unit
    return dict(index=i, kind=MAMBA, mixer="Mamba-1", heads=inner,
                state_elems=inner * d_state, conv_elems=inner * (d_conv - 1),
                linear_flops=2 * proj + 6 * inner * d_state)
