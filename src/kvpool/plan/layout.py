"""Which decoder layer is which: one layout token per layer, from ``config.json``.

Tokens: ``full`` (softmax attention over every earlier token), ``sliding`` (the last
``sliding_window`` tokens), ``chunked`` (tokens of the current ``attention_chunk_size``
chunk), ``recurrent`` (a fixed per-request state: Gated DeltaNet, KDA, Mamba; which one
is decided by :mod:`kvpool.plan.recurrent` from the config's fields) and ``ffn`` (an
MLP/MoE-only layer with no cache, Nemotron-H). The first rule that applies wins, in
this order; every rule is the one transformers' config class applies (cited per rule):

1. ``layer_types`` (transformers >= 4.53 and 5.x configs) or ``layers_block_type``
   (what ``NemotronHConfig`` saves): ``full_attention`` / ``attention``,
   ``sliding_attention``, ``chunked_attention``, ``linear_attention`` / ``mamba``
   (the names ``configuration_utils.ALLOWED_ATTN_LAYER_TYPES`` gives recurrent layers),
   ``mlp`` / ``moe``. Any other name is an error naming the field and the name.
2. ``hybrid_override_pattern`` (Nemotron-H): one character per layer, ``M`` Mamba-2,
   ``*`` attention, ``-`` MLP, ``E`` MoE (``NemotronHConfig._pattern_to_list``).
3. ``linear_attn_config`` with ``full_attn_layers`` / ``kda_layers`` (Kimi Linear):
   1-based layer numbers (``KimiLinearConfig``).
4. ``full_attention_interval`` (Qwen3-Next, Qwen3.5): layer ``i`` is full attention
   when ``(i + 1) % interval == 0``, else linear (``Qwen3NextConfig``).
5. ``attn_layer_period`` + ``attn_layer_offset`` (Jamba): attention when
   ``i % period == offset``, else Mamba (``JambaConfig.layers_block_type``).
6. ``attn_layer_indices`` (Bamba): 0-based attention layers, the rest Mamba-2
   (``BambaConfig.layers_block_type``).
7. ``model_type`` ``mamba`` / ``mamba2`` / ``falcon_mamba``: every layer recurrent.
8. Alternation by model: ``gemma2`` and ``gpt_oss`` slide on even layers
   (``(i + 1) % 2``), ``gemma3`` / ``gemma3_text`` on all but every 6th; an explicit
   ``sliding_window_pattern`` ``p`` overrides the period: layer ``i`` slides unless
   ``(i + 1) % p == 0`` (``Gemma3TextConfig``, ``Cohere2Config``).
9. ``use_sliding_window`` (Qwen2): when true, layers ``>= max_window_layers`` slide;
   when false none does, whatever ``sliding_window`` says (``Qwen2Config``).
10. otherwise a non-null ``sliding_window`` applies to every layer (Mistral-7B-v0.1).

``attention_chunk_size`` without a ``layer_types`` list (Llama 4 derives it from
``no_rope_layers``) is refused rather than guessed.
"""

from __future__ import annotations

from kvpool.plan.fields import Fields

FULL, SLIDING, CHUNKED, RECURRENT, FFN = "full", "sliding", "chunked", "recurrent", "ffn"

LAYER_TYPE_NAMES = {
    "full_attention": FULL, "attention": FULL, "sliding_attention": SLIDING,
    "chunked_attention": CHUNKED, "linear_attention": RECURRENT, "mamba": RECURRENT,
    "kda": RECURRENT, "mlp": FFN, "moe": FFN,
}
_PATTERN_CHARS = {"M": RECURRENT, "*": FULL, "-": FFN, "E": FFN}
_ALL_RECURRENT = ("mamba", "mamba2", "falcon_mamba")
_SLIDING_PERIOD = {"gemma2": 2, "gpt_oss": 2, "gemma3": 6, "gemma3_text": 6}


def layer_layout(f: Fields, n: int) -> tuple[list[str], str]:
    """One token per layer for ``n`` layers, and the field that decided it (for
    messages). Raises UserError naming the field on a malformed or unknown value."""
    for name in ("layer_types", "layers_block_type"):
        if f.has(name):
            return _typed(f, name, n), name
    if f.has("hybrid_override_pattern"):
        return _pattern(f, n), "hybrid_override_pattern"
    if isinstance(f.get("linear_attn_config"), dict):
        return _kimi(f, n), "linear_attn_config"
    if f.has("full_attention_interval"):
        every = f.int("full_attention_interval", "which layers are full attention")
        return [RECURRENT if (i + 1) % every else FULL for i in range(n)], \
            "full_attention_interval"
    if f.has("attn_layer_period"):
        period = f.int("attn_layer_period", "which layers are attention")
        offset = f.int("attn_layer_offset", "which layers are attention", 0)
        if offset >= period:
            raise f.error(f"field 'attn_layer_offset' ({offset}) must be smaller than "
                          f"'attn_layer_period' ({period})")
        return [FULL if i % period == offset else RECURRENT for i in range(n)], \
            "attn_layer_period"
    if f.has("attn_layer_indices"):
        attn = set(f.int_list("attn_layer_indices", n, 0))
        return [FULL if i in attn else RECURRENT for i in range(n)], "attn_layer_indices"
    if f.get("model_type") in _ALL_RECURRENT:
        return [RECURRENT] * n, "model_type"
    if f.has("attention_chunk_size"):
        raise f.error("field 'attention_chunk_size' (chunked local attention, Llama 4) needs "
                      "a 'layer_types' list saying which layers are chunked_attention")
    return _windows(f, n)


def _typed(f: Fields, name: str, n: int) -> list[str]:
    types = f.get(name)
    if not isinstance(types, list) or len(types) != n:
        raise f.error(f"field {name!r} must list {n} layer types (num_hidden_layers)")
    unknown = sorted({t for t in types if t not in LAYER_TYPE_NAMES}, key=str)
    if unknown:
        raise f.error(f"field {name!r} has unknown type(s) {unknown}; "
                      f"known: {sorted(LAYER_TYPE_NAMES)}")
    return [LAYER_TYPE_NAMES[t] for t in types]


def _pattern(f: Fields, n: int) -> list[str]:
    pattern = f.get("hybrid_override_pattern")
    if not isinstance(pattern, str) or len(pattern) != n:
        raise f.error(f"field 'hybrid_override_pattern' must be a string of {n} characters "
                      f"(num_hidden_layers), got {pattern!r}")
    unknown = sorted(set(pattern) - set(_PATTERN_CHARS))
    if unknown:
        raise f.error(f"field 'hybrid_override_pattern' has unknown layer character(s) "
                      f"{unknown}; known: M (Mamba-2), * (attention), - (MLP), E (MoE)")
    return [_PATTERN_CHARS[c] for c in pattern]


def _kimi(f: Fields, n: int) -> list[str]:
    sub = Fields(f.get("linear_attn_config"), f"{f.source}: linear_attn_config")
    kinds: list[str | None] = [None] * n
    for name, kind in (("full_attn_layers", FULL), ("kda_layers", RECURRENT)):
        for i in sub.int_list(name, n, 1) if sub.has(name) else []:
            kinds[i] = kind
    missing = [i + 1 for i, k in enumerate(kinds) if k is None]
    if missing:
        raise sub.error(f"lists no type for layer(s) {missing} "
                        "(expected in full_attn_layers or kda_layers)")
    return kinds  # type: ignore[return-value]


def _windows(f: Fields, n: int) -> tuple[list[str], str]:
    model_type = f.get("model_type")
    if f.has("sliding_window_pattern") or (model_type in _SLIDING_PERIOD
                                           and f.has("sliding_window")):
        period = (f.int("sliding_window_pattern", "the sliding/global interleave")
                  if f.has("sliding_window_pattern") else _SLIDING_PERIOD[model_type])
        field = "sliding_window_pattern" if f.has("sliding_window_pattern") else "model_type"
        return [SLIDING if (i + 1) % period else FULL for i in range(n)], field
    if "use_sliding_window" in f.cfg:
        start = f.int("max_window_layers", "which layers slide", 0) if f.get(
            "use_sliding_window") else n
        return [SLIDING if i >= start else FULL for i in range(n)], "use_sliding_window"
    if f.has("sliding_window"):
        return [SLIDING] * n, "sliding_window"
    return [FULL] * n, "num_hidden_layers"
