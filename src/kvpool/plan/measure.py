"""Check the prefill model against the reference engine on this machine (``--measure``).

1. Cold runs (nothing cached) at a few prompt lengths fit the overhead and the linear
   and attention FLOP/s (:func:`kvpool.plan.fit.fit_cold`).
2. The KV load bandwidth is measured on the engine's own load step (prefix-cache
   lookup, then ``cache.load(m, out=...)`` copying each page straight into the
   engine's KV buffer, then the transformers cache over it) for pages the cold runs
   stored, unless ``--bandwidth`` is given.
3. For each hit ratio, a prompt's first ``P`` tokens are cached by a priming request,
   then the whole prompt runs and its TTFT is compared with the prediction, made for
   the engine's attention kernel (``causal`` for its default ``kvpool_causal`` split
   kernel, ``masked`` for transformers' SDPA with an explicit mask; see
   :mod:`kvpool.plan.prefill`) and, for reference, for the other one.

Every run uses a fresh random prompt (its own prefix chain), so a run only ever reuses
what its own priming stored. Rounds interleave all points, so a slow spell of the
machine spreads over every point. Each point's figure is the fastest of its rounds by
default (``stat="min"``): on a shared machine other processes only ever add time, so
the minimum is the least disturbed run (the reasoning of Python's ``timeit``); every
sample is kept in the JSON.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from kvpool.errors import KVPoolError, UserError
from kvpool.plan.fit import Fit, fit_cold
from kvpool.plan.kv import plan_kv
from kvpool.plan.prefill import cached_tokens, predict_ttft
from kvpool.plan.spec import ModelSpec, spec_from_config

HITS = (0.0, 0.25, 0.5, 0.75, 0.9)
CLOCKS = ("wall", "cpu")
TOLERANCE = 0.20  # the goal: predictions within 20% of the measured TTFT


class EngineMeter:
    """Measures TTFT on :class:`kvpool.engine.Engine` with an L1-only PrefixCache.

    ``attention`` is the engine's kernel ("kvpool_causal", its default, or "sdpa", the
    stock masked path; InvalidParams otherwise); ``attention_kernel`` is the planner's
    name for the one that runs ("causal" or "masked").

    ``clock="wall"`` is the engine's own ``ttft_ms``. ``clock="cpu"`` is the CPU time
    of this thread from the start of the request to the end of the prefill forward
    (one torch thread only): on a machine shared with busy processes, wall time mostly
    measures the scheduler, while the thread's CPU time is close to the wall time the
    same work takes on a quiet machine.

    ``measure_ttft(prompt_ids, cached_tokens) -> ms`` is the interface the fit and the
    comparison use; any object with it, ``spec``, ``page_size``, ``kv_dtype``, ``vocab``,
    ``attention_kernel`` and ``load_bandwidth(prompt_ids)`` can stand in for the engine.
    """

    def __init__(self, model: str = "smollm2", dtype: str = "float32", page_size: int = 16,
                 max_prompt: int = 2048, clock: str = "wall", attention: str = "kvpool_causal"):
        import torch

        if clock not in CLOCKS:
            raise UserError(f"clock must be one of {', '.join(CLOCKS)}, got {clock!r}")
        if clock == "cpu" and torch.get_num_threads() != 1:
            raise UserError("--clock cpu counts one thread's CPU time: use --threads 1")
        self.clock = clock

        from kvpool.cache import PrefixCache
        from kvpool.engine import Engine
        from kvpool.engine import attention as attn

        self.engine = Engine(model, dtype=dtype, attention=attention)
        # the engine's split kernel computes only the causal pairs after a prefix; the
        # stock SDPA path (its fallback) gets an explicit mask and computes the whole
        # (new tokens x all tokens) rectangle
        self.attention_kernel = "causal" if self.engine.attention == attn.NAME else "masked"
        self.page_size = page_size
        self.kv_dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[dtype]
        config = self.engine.config
        self.vocab = config.vocab_size
        name = self.engine.loaded.name
        self.spec = spec_from_config({**config.to_dict(), "_name_or_path": name},
                                     source=f"{name} config")
        # room for one whole prompt plus a primed prefix; older pages are evicted (LRU)
        pages = 2 * (-(-max_prompt // page_size)) + 8
        self.cache = PrefixCache(self.engine.namespace(page_size),
                                 page_shape=self.engine.page_shape(page_size),
                                 dtype=getattr(torch, dtype), l1_pages=pages)
        self.engine.cache = self.cache

    def measure_ttft(self, prompt_ids: list[int], cached: int) -> float:
        """TTFT in ms of ``prompt_ids`` after caching its first ``cached`` tokens (a
        multiple of the page size; 0 = cold). Raises KVPoolError if the engine reused
        another number of tokens than asked (the point would measure something else)."""
        if cached:
            self.engine.generate(prompt_ids[:cached], max_new_tokens=1)
        marks: list[float] = []
        # the model's first forward is the prefill: its end is the first token's logits
        hook = self.engine.model.register_forward_hook(lambda *_: marks.append(time.thread_time()))
        start = time.thread_time()
        try:
            r = self.engine.generate(prompt_ids, max_new_tokens=1)
        finally:
            hook.remove()
        if r.reused_tokens != cached:
            raise KVPoolError(f"engine reused {r.reused_tokens} tokens, expected {cached}")
        return r.ttft_ms if self.clock == "wall" else (marks[0] - start) * 1e3

    def load_bandwidth(self, prompt_ids: list[int]) -> float:
        """Bytes/s of the engine's own load step (lookup, then ``cache.load`` straight
        into the engine's KV buffer, then the cache over it) for the cached pages of
        ``prompt_ids``. Raises KVPoolError when none of them is cached."""
        import torch

        engine, cache = self.engine, self.cache
        now = time.perf_counter if self.clock == "wall" else time.thread_time
        with torch.inference_mode():  # as in Engine.generate
            seq = engine.sequence_buffer(len(prompt_ids) + 1)
            start = now()
            timings = dict.fromkeys(("lookup", "load"), 0.0)
            kv, _ = engine.load_prefix(cache, prompt_ids, seq, timings)
            seconds = now() - start
        pages = kv.get_seq_length() // cache.page_size
        if not pages:
            raise KVPoolError("no cached page to time the load path on")
        page_bytes = math.prod(engine.page_shape(cache.page_size)) * seq.element_size()
        return pages * page_bytes / seconds


@dataclass(frozen=True)
class Row:
    """One hit ratio: predicted and measured TTFT (ms) and the relative error;
    ``other_kernel_ms`` is the prediction for the other attention kernel
    (``MeasureResult.other_kernel``: "masked" when the engine's is "causal", and back)."""

    hit: float
    cached: int
    predicted_ms: float
    measured_ms: float
    other_kernel_ms: float
    samples_ms: list
    error: float
    parts_ms: dict


@dataclass(frozen=True)
class MeasureResult:
    model: str
    prompt: int
    threads: int
    clock: str
    repeats: int
    stat: str
    fit_runs_ms: dict
    fit: dict
    bandwidth_gbps: float
    bandwidth_source: str
    attention_kernel: str
    other_kernel: str
    rows: list
    max_error: float
    within_tolerance: bool

    def to_dict(self) -> dict:
        return asdict(self)


def fit_lengths(prompt: int, page_size: int) -> list[int]:
    """Cold-run prompt lengths for the fit: N/16, N/8, N/4, N/2, 3N/4 and N, in whole
    pages (the new tokens of a 90% hit down to a cold run)."""
    lengths = {max(page_size, (prompt * k // 16) // page_size * page_size)
               for k in (1, 2, 4, 8, 12)}
    return sorted(lengths | {prompt})


def run_measure(meter, prompt: int, hits=HITS, repeats: int = 3, bandwidth: float | None = None,
                stat: str = "min", kernel: str | None = None, seed: int = 0,
                progress=print) -> MeasureResult:
    """Fit on cold runs, then predict and measure TTFT at each hit ratio (module doc).

    Args:
        meter: an :class:`EngineMeter` (or an object with its interface).
        prompt: prompt length N in tokens.
        hits: hit ratios in [0, 1).
        repeats: rounds, each measuring every point once.
        bandwidth: KV load bytes/s; None = measure the engine's load path.
        stat: "min" or "median" of the rounds, for the fit and the comparison alike.
        kernel: attention kernel of the prediction; None = the meter's own.
    """
    import torch

    rng = np.random.default_rng(seed)

    def fresh(n: int) -> list[int]:
        return rng.integers(0, meter.vocab, size=n).tolist()

    lengths = fit_lengths(prompt, meter.page_size)
    points = [(n, 0) for n in lengths] + [(prompt, cached_tokens(prompt, h, meter.page_size))
                                          for h in hits]
    meter.measure_ttft(fresh(min(prompt, 256)), 0)  # warm-up: first-call allocations
    samples: dict[int, list[float]] = {i: [] for i in range(len(points))}
    for r in range(repeats):
        for i, (n, cached) in enumerate(points):
            samples[i].append(meter.measure_ttft(fresh(n), cached))
        progress(f"round {r + 1}/{repeats} done")
    pick = {"min": min, "median": statistics.median}[stat]
    figure = [pick(samples[i]) for i in range(len(points))]
    cold = list(zip(lengths, figure[:len(lengths)]))
    fit = fit_cold(meter.spec, [(n, ms / 1e3) for n, ms in cold])
    source = "given (--bandwidth)"
    if bandwidth is None:
        ids = fresh(prompt)
        meter.measure_ttft(ids, 0)  # stores the prompt's pages
        bandwidth = statistics.median([meter.load_bandwidth(ids) for _ in range(3)])
        source = "measured: engine load path (lookup + cache.load into the KV buffer)"
    kernel = kernel or meter.attention_kernel
    other = "masked" if kernel == "causal" else "causal"
    rates, other_rates = fit.rates(bandwidth, kernel), fit.rates(bandwidth, other)
    rows = []
    for h, (n, cached), measured in zip(hits, points[len(lengths):], figure[len(lengths):]):
        t = predict_ttft(meter.spec, n, cached, rates, meter.kv_dtype)
        alt = predict_ttft(meter.spec, n, cached, other_rates, meter.kv_dtype)
        rows.append(Row(hit=h, cached=cached, predicted_ms=t.total * 1e3, measured_ms=measured,
                        other_kernel_ms=alt.total * 1e3,
                        samples_ms=samples[len(lengths) + len(rows)],
                        error=t.total * 1e3 / measured - 1,
                        parts_ms={"overhead": t.overhead * 1e3, "linear": t.linear * 1e3,
                                  "attention": t.attention * 1e3, "load": t.load * 1e3}))
    worst = max(abs(r.error) for r in rows)
    return MeasureResult(
        model=meter.spec.name, prompt=prompt, threads=torch.get_num_threads(),
        clock=getattr(meter, "clock", "wall"), repeats=repeats, stat=stat,
        fit_runs_ms={str(n): ms for n, ms in cold}, fit=_fit_dict(fit),
        bandwidth_gbps=bandwidth / 1e9, bandwidth_source=source, attention_kernel=kernel,
        other_kernel=other, rows=[asdict(r) for r in rows],
        max_error=float(worst), within_tolerance=bool(worst <= TOLERANCE))


def _fit_dict(fit: Fit) -> dict:
    return {"linear_gflops": float(fit.linear_flops / 1e9),
            "attention_gflops": float(fit.attention_flops / 1e9),
            "overhead_ms": float(fit.overhead_s * 1e3),
            "max_rel_error_on_fit_runs": float(fit.max_rel_error)}


def check_same_model(config_spec: ModelSpec, engine_spec: ModelSpec, kv_dtype: str) -> None:
    """Raise UserError when CONFIG.json does not describe the engine's model (other
    layers, KV shape or matmul work), so a measurement never validates another model."""
    same = (len(config_spec.layers) == len(engine_spec.layers)
            and plan_kv(config_spec, kv_dtype).per_token == plan_kv(engine_spec, kv_dtype).per_token
            and [x.linear_flops for x in config_spec.layers]
            == [x.linear_flops for x in engine_spec.layers])
    if not same:
        raise UserError(f"{config_spec.name} does not describe the engine's model "
                        f"({engine_spec.name}); give the matching config or --model")


def format_table(result: MeasureResult) -> str:
    """The predicted-vs-measured table as Markdown."""
    lines = ["| hit | cached tokens | predicted TTFT ms | measured TTFT ms | error "
             f"| with a {result.other_kernel} kernel ms |",
             "|---:|---:|---:|---:|---:|---:|"]
    for r in result.rows:
        lines.append(f"| {r['hit']:.0%} | {r['cached']} | {r['predicted_ms']:.0f} | "
                     f"{r['measured_ms']:.0f} | {r['error']:+.1%} | "
                     f"{r['other_kernel_ms']:.0f} |")
    return "\n".join(lines)


def write_outputs(result: MeasureResult, out: str) -> tuple[Path, Path]:
    """Write ``OUT.json`` and ``OUT.png`` (matplotlib, Agg backend); returns both paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    base = Path(out)
    base.parent.mkdir(parents=True, exist_ok=True)
    json_path, png_path = base.with_suffix(".json"), base.with_suffix(".png")
    json_path.write_text(json.dumps(result.to_dict(), indent=2) + "\n")
    hits = [r["hit"] * 100 for r in result.rows]
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    ax.plot(hits, [r["predicted_ms"] for r in result.rows], "o-",
            label=f"predicted ({result.attention_kernel} attention kernel)")
    ax.plot(hits, [r["measured_ms"] for r in result.rows], "s",
            label=f"measured ({result.stat} of {result.repeats})")
    ax.plot(hits, [r["other_kernel_ms"] for r in result.rows], "--", color="tab:green",
            label=f"predicted with a {result.other_kernel} attention kernel")
    cold = result.rows[0]["measured_ms"] if result.rows[0]["hit"] == 0 else None
    if cold is not None:
        ax.plot(hits, [cold * (1 - h / 100) for h in hits], ":", color="grey",
                label="cold × (1 − hit): what '50% hit = 2×' assumes")
    ax.set_xlabel("prefix hit ratio (%)")
    ax.set_ylabel(f"TTFT (ms, {result.clock} clock)")
    ax.set_title(f"{result.model}: prompt {result.prompt} tokens, {result.threads} thread(s)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)
    return json_path, png_path
