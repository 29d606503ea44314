"""What a prefix hit saves in a prefill: FLOPs, load cost, TTFT and break-even bandwidth.

A prompt of ``N`` tokens whose first ``P`` tokens' KV is cached still computes the last
``N − P`` tokens. Work splits in two (Kaplan et al. 2020, "Scaling Laws", §2.1, count
2 FLOPs per weight per token plus the attention term; causal masking halves it):

- linear: projections and MLP, a fixed number of FLOPs per token, so ``∝ N − P``;
- attention: query ``i`` (0-based) scores and mixes ``i + 1`` keys, so the new tokens
  cost ``Σ_{i=P}^{N−1} (i + 1) = (N(N+1) − P(P+1)) / 2 ≈ (N² − P²) / 2`` (query, key)
  pairs per layer: the causal triangle minus its cached corner. A sliding window or a
  top-k selection caps the keys per query at ``W``.

With hit ratio ``h = P / N`` the linear work falls to ``1 − h`` but the attention work
only to ``1 − h²`` (75% left at a 50% hit): the new tokens still read the whole prefix.
Time adds a fixed per-request overhead and the load of the cached KV
(bytes from :func:`kvpool.plan.kv.plan_kv` over the bandwidth):

    TTFT(N, P) = overhead + F_lin(N−P)/R_lin + F_attn(N, P)/R_attn + bytes(P)/B

Fetching beats recomputing when ``bytes(P)/B`` is below the compute time saved, so the
break-even bandwidth is ``B* = bytes(P) / (T_compute(N, 0) − T_compute(N, P))``.

Attention kernels (:data:`KERNELS`) differ in the pairs they really compute after a
cached prefix. ``causal``: a kernel with a bottom-right causal mask (FlashAttention,
FlashInfer, as vLLM and SGLang run it; kvpool's engine by default, with its
``kvpool_causal`` split kernel) skips the masked pairs, as above. ``masked``: a kernel
handed an explicit mask computes every (new query, key) pair, ``(N − P) · N``, and
masks afterwards; PyTorch's ``scaled_dot_product_attention`` with ``attn_mask`` does
this, and it is how transformers' stock ``sdpa`` path runs a prefill after cached
tokens (the engine's ``attention="sdpa"``). There a 50% hit saves no attention work at
all. A cold prefill (``P = 0``) runs the causal kernel in both.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from kvpool.errors import UserError
from kvpool.plan.kv import plan_kv
from kvpool.plan.spec import ModelSpec, check_flops

# Defaults of `kvpool plan prefill`: the speeds are the `--measure` fit of SmolLM2-135M
# fp32 on the 2-core development machine, torch's default 2 threads (docs/plan.md); the
# bandwidth is in the range docs/bench.md measured for kvpool's data paths (TCP about
# 1-3 GB/s, shared memory 4-10 GB/s). Give a deployment's own figures, or --measure.
DEFAULT_LINEAR_FLOPS = 170e9
DEFAULT_ATTENTION_FLOPS = 150e9
DEFAULT_OVERHEAD_MS = 50.0
DEFAULT_BANDWIDTH_GBPS = 5.0
KERNELS = ("causal", "masked")


@dataclass(frozen=True)
class Rates:
    """Effective speeds of one deployment: ``linear`` and ``attention`` FLOP/s,
    ``overhead_s`` per request (seconds), ``bandwidth`` of the KV load (bytes/s, per
    rank), and its ``attention_kernel`` (one of :data:`KERNELS`, module docstring).
    """

    linear: float = DEFAULT_LINEAR_FLOPS
    attention: float = DEFAULT_ATTENTION_FLOPS
    overhead_s: float = DEFAULT_OVERHEAD_MS / 1e3
    bandwidth: float = DEFAULT_BANDWIDTH_GBPS * 1e9
    attention_kernel: str = "causal"

    def __post_init__(self):
        if self.attention_kernel not in KERNELS:
            raise UserError(f"attention kernel must be one of {', '.join(KERNELS)}, "
                            f"got {self.attention_kernel!r}")
        for name, unit in (("linear", "FLOP/s"), ("attention", "FLOP/s"), ("bandwidth", "bytes/s")):
            if not getattr(self, name) > 0:
                raise UserError(f"{name} rate must be > 0 {unit}, got {getattr(self, name):g} {unit}")
        if not self.overhead_s >= 0:
            raise UserError(f"overhead must be >= 0 s, got {self.overhead_s:g} s")


@dataclass(frozen=True)
class PrefillFlops:
    """FLOPs of one prefill of ``prompt`` tokens with ``cached`` tokens reused:
    ``linear`` (∝ new tokens, plus the LM head on the last token) and ``attention``
    (softmax attention pairs and the sparse-attention indexer)."""

    prompt: int
    cached: int
    linear: float
    attention: float

    @property
    def total(self) -> float:
        return self.linear + self.attention


def causal_pairs(prompt: int, cached: int, cap: int | None = None) -> int:
    """(query, key) pairs the new tokens ``cached..prompt−1`` attend, each query seeing
    itself and every earlier token, at most ``cap`` of them: ``S(N) − S(P)`` with
    ``S(n) = Σ_{j=1}^{n} min(j, cap)``."""
    return _pairs_upto(prompt, cap) - _pairs_upto(cached, cap)


def _pairs_upto(n: int, cap: int | None) -> int:
    if cap is None or n <= cap:
        return n * (n + 1) // 2
    return cap * (cap + 1) // 2 + (n - cap) * cap


def prefill_flops(spec: ModelSpec, prompt: int, cached: int = 0,
                  kernel: str = "causal") -> PrefillFlops:
    """FLOPs to prefill ``prompt`` tokens when the first ``cached`` are reused, as the
    attention ``kernel`` computes them (module docstring).

    Raises: UserError unless ``0 <= cached < prompt`` (the last token is always computed),
    or when the config lacked a field the FLOPs need (``spec.flops_error``).
    """
    _check(prompt, cached)
    check_flops(spec)
    new = prompt - cached
    linear = sum(layer.linear_flops for layer in spec.layers) * new + spec.head_flops
    attention = sum(
        layer.pair_flops * (causal_pairs(prompt, cached, layer.pair_cap)
                            if kernel == "causal" or not cached else new * prompt)
        + layer.index_pair_flops * causal_pairs(prompt, cached)
        for layer in spec.layers)
    return PrefillFlops(prompt, cached, float(linear), float(attention))


def _check(prompt: int, cached: int) -> None:
    if prompt < 1:
        raise UserError(f"--prompt must be >= 1, got {prompt}")
    if not 0 <= cached < prompt:
        raise UserError(f"cached tokens must be in [0, {prompt - 1}] (the last prompt token is "
                        f"always computed), got {cached}")


def cached_tokens(prompt: int, hit: float, page_size: int = 1) -> int:
    """Tokens reused for hit ratio ``hit`` in [0, 1): ``hit · prompt`` rounded down to
    whole pages, and at most ``prompt − 1``. Raises UserError outside [0, 1)."""
    if not 0 <= hit < 1:
        raise UserError(f"--hit must be in [0, 1), got {hit}")
    tokens = int(hit * prompt) // page_size * page_size
    return min(tokens, (prompt - 1) // page_size * page_size)


@dataclass(frozen=True)
class TTFT:
    """Predicted time to first token, split into its parts (seconds)."""

    prompt: int
    cached: int
    overhead: float
    linear: float
    attention: float
    load: float
    load_bytes: int

    @property
    def compute(self) -> float:
        return self.linear + self.attention

    @property
    def total(self) -> float:
        return self.overhead + self.compute + self.load


def kv_bytes(spec: ModelSpec, tokens: int, kv_dtype: str, tp: int = 1, pp: int = 1) -> int:
    """Bytes one rank loads for a cached prefix of ``tokens`` tokens (KV, and the
    fixed state of linear-attention layers at that position); 0 for no tokens."""
    if tokens == 0:
        return 0
    return plan_kv(spec, kv_dtype, tokens=tokens, tp=tp, pp=pp).per_request_rank


def predict_ttft(spec: ModelSpec, prompt: int, cached: int, rates: Rates,
                 kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> TTFT:
    """TTFT of a ``prompt``-token prefill with ``cached`` tokens loaded (module formula)."""
    flops = prefill_flops(spec, prompt, cached, rates.attention_kernel)
    nbytes = kv_bytes(spec, cached, kv_dtype, tp, pp)
    return TTFT(prompt, cached, rates.overhead_s, flops.linear / rates.linear,
                flops.attention / rates.attention, nbytes / rates.bandwidth, nbytes)


def break_even_bandwidth(spec: ModelSpec, prompt: int, cached: int, rates: Rates,
                         kv_dtype: str = "bf16", tp: int = 1, pp: int = 1) -> float:
    """Bytes/s below which recomputing the ``cached`` tokens is faster than loading
    them: ``bytes(P) / (T_compute(N, 0) − T_compute(N, P))``. ``inf`` when nothing is
    cached or nothing would be saved."""
    cold = predict_ttft(spec, prompt, 0, rates, kv_dtype, tp, pp)
    warm = predict_ttft(spec, prompt, cached, rates, kv_dtype, tp, pp)
    saved = cold.compute - warm.compute
    return warm.load_bytes / saved if cached and saved > 0 else float("inf")


@dataclass(frozen=True)
class PrefillReport:
    """Everything `kvpool plan prefill` prints for one (prompt, hit)."""

    model: str
    prompt: int
    hit: float
    cached: int
    kv_dtype: str
    rates: dict
    flops_cold: dict
    flops_hit: dict
    linear_fraction_left: float
    attention_fraction_left: float
    ideal_speedup: float
    ttft_cold_ms: float
    ttft_hit_ms: float
    ttft_hit_parts_ms: dict
    predicted_speedup: float
    load_bytes: int
    break_even_gbps: float
    explanation: str

    def to_dict(self) -> dict:
        return asdict(self)


def prefill_report(spec: ModelSpec, prompt: int, hit: float, rates: Rates,
                   kv_dtype: str = "bf16", tp: int = 1, pp: int = 1,
                   page_size: int = 1) -> PrefillReport:
    """Cold vs hit FLOPs, TTFT, ideal and predicted speedup, break-even bandwidth.

    ``ideal_speedup`` is the compute speedup with a causal kernel and free loading;
    everything else follows ``rates`` (kernel included)."""
    cached = cached_tokens(prompt, hit, page_size)
    kernel = rates.attention_kernel
    cold, warm = prefill_flops(spec, prompt, 0), prefill_flops(spec, prompt, cached, kernel)
    ideal = prefill_flops(spec, prompt, cached, "causal")
    t_cold = predict_ttft(spec, prompt, 0, rates, kv_dtype, tp, pp)
    t_hit = predict_ttft(spec, prompt, cached, rates, kv_dtype, tp, pp)
    lin_left = warm.linear / cold.linear
    attn_left = warm.attention / cold.attention if cold.attention else 0.0
    be = break_even_bandwidth(spec, prompt, cached, rates, kv_dtype, tp, pp)
    report = PrefillReport(
        model=spec.name, prompt=prompt, hit=hit, cached=cached, kv_dtype=kv_dtype,
        rates=asdict(rates),
        flops_cold={"linear": cold.linear, "attention": cold.attention},
        flops_hit={"linear": warm.linear, "attention": warm.attention},
        linear_fraction_left=lin_left, attention_fraction_left=attn_left,
        ideal_speedup=cold.total / ideal.total,
        ttft_cold_ms=t_cold.total * 1e3, ttft_hit_ms=t_hit.total * 1e3,
        ttft_hit_parts_ms={"overhead": t_hit.overhead * 1e3, "linear": t_hit.linear * 1e3,
                           "attention": t_hit.attention * 1e3, "load": t_hit.load * 1e3},
        predicted_speedup=t_cold.total / t_hit.total, load_bytes=t_hit.load_bytes,
        break_even_gbps=be / 1e9, explanation="")
    return _with_explanation(report, cold)


def _versus_hit_ratio(r: PrefillReport) -> str:
    """The ideal speedup next to the ``N / (N − P)`` the reused share alone suggests."""
    naive = r.prompt / (r.prompt - r.cached)
    ideal = f"{r.ideal_speedup:.2f}x"
    if ideal == f"{naive:.2f}x":
        return f"{ideal}, all that reusing {r.cached / r.prompt:.1%} of the tokens can give"
    side = "less" if r.ideal_speedup < naive else "more"
    return (f"{ideal}, {side} than the {naive:.2f}x that reusing {r.cached / r.prompt:.1%} "
            "of the tokens suggests")


def _with_explanation(r: PrefillReport, cold: PrefillFlops) -> PrefillReport:
    attn_share = cold.attention / cold.total
    left = f"{r.attention_fraction_left:.0%} of the attention work is left"
    attention = (
        f"so the causal triangle loses only its cached corner: (N^2 - P^2)/N^2, {left}."
        if r.rates["attention_kernel"] == "causal" else
        f"and a kernel given an explicit mask computes every (new query, key) pair, "
        f"(N - P)*N, so {left} (a causal kernel would leave (N^2 - P^2)/N^2).")
    text = (
        f"A {r.hit:.0%} hit reuses {r.cached} of {r.prompt} tokens. The linear work "
        f"(projections, MLP) is per new token, so {r.linear_fraction_left:.0%} of it is left. "
        f"Attention is not: each new token still attends to the whole cached prefix, "
        f"{attention} Attention is {attn_share:.0%} of this cold prefill, so the ideal "
        f"compute speedup is {_versus_hit_ratio(r)}. Loading the "
        f"cached KV ({r.load_bytes / 1e6:.1f} MB) adds {r.ttft_hit_parts_ms['load']:.1f} ms and "
        f"the fixed overhead of {r.ttft_hit_parts_ms['overhead']:.1f} ms is not saved at all, "
        f"so the predicted TTFT speedup is {r.predicted_speedup:.2f}x. Below "
        f"{r.break_even_gbps:.3g} GB/s, recomputing those tokens is faster than loading them."
    ) if r.cached else "No token is reused: the prefill runs cold."
    return PrefillReport(**{**asdict(r), "explanation": text})
