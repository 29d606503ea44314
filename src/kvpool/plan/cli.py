"""``kvpool plan kv|prefill``: KV sizing and prefill prediction from a config.json.

CONFIG may be a path or the name of a shipped config (``kvpool plan kv llama-3-8b``;
the list is in ``kvpool plan kv --help``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kvpool.config import check_at_least, check_output_path
from kvpool.errors import UserError
from kvpool.plan.kv import DTYPE_BYTES, KVPlan, plan_kv
from kvpool.plan.link import Link, crossover
from kvpool.plan.prefill import (DEFAULT_ATTENTION_FLOPS, DEFAULT_BANDWIDTH_GBPS,
                                 DEFAULT_LINEAR_FLOPS, DEFAULT_OVERHEAD_MS, KERNELS,
                                 PrefillReport, Rates, prefill_report)
from kvpool.plan.spec import configs_dir, load_spec

HELP = "size a KV pool from a model's config.json, and predict what a prefix hit saves"


def _shipped() -> str:
    return ", ".join(sorted(p.stem for p in configs_dir().glob("*.json")))


def _load_spec(config: str):
    """load_spec, whose error for a name that is neither a file nor shipped lists the
    shipped names."""
    try:
        return load_spec(config)
    except UserError as exc:
        if Path(config).expanduser().exists():
            raise
        raise UserError(f"{exc} (not a file; shipped configs: {_shipped()})") from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    shipped = _shipped()
    sub = parser.add_subparsers(dest="plan_command", metavar="{kv,prefill}", required=True)
    kv = sub.add_parser("kv", help="KV bytes per token, page, request and pool",
                        description="KV bytes per token (total and per rank), per page, per "
                        f"request and for the whole pool. Shipped configs: {shipped}.")
    _common(kv)
    kv.add_argument("--tokens", type=int, default=4096, help="tokens per request (default 4096)")
    kv.add_argument("--requests", type=int, default=1,
                    help="requests held at once in the pool (default 1)")
    kv.add_argument("--state-dtype", default=None, choices=sorted(DTYPE_BYTES),
                    help="recurrent-state element type of linear-attention / Mamba layers "
                    "(default: the config's mamba_ssm_cache_dtype / mamba_ssm_dtype, else "
                    "the KV dtype; the conv state stays at the KV dtype)")
    kv.set_defaults(_plan=_run_kv)

    pf = sub.add_parser("prefill", help="prefill FLOPs and TTFT with a prefix hit",
                        description="Prefill FLOPs (linear + causal attention), TTFT with and "
                        "without a prefix hit, and the break-even bandwidth of fetching the "
                        f"cached KV against recomputing it. Shipped configs: {shipped}.")
    _common(pf)
    pf.add_argument("--prompt", type=int, required=True, help="prompt length N in tokens")
    pf.add_argument("--hit", type=float, default=0.5,
                    help="prefix hit ratio in [0, 1): cached tokens / N (default 0.5)")
    pf.add_argument("--bandwidth", type=float, default=None,
                    help=f"KV load bandwidth in GB/s per rank (default {DEFAULT_BANDWIDTH_GBPS}; "
                    "with --measure, measured on the engine's load path)")
    pf.add_argument("--link-gbit", type=float, default=None,
                    help="load the cached KV over a network link of this line rate in Gbit/s "
                    "(instead of --bandwidth: TCP payload share of the rate) and print the "
                    "prefix length from which fetching beats recomputing")
    pf.add_argument("--link-delay-ms", type=float, default=0.0,
                    help="one-way delay of --link-gbit's link in ms (default 0)")
    pf.add_argument("--linear-flops", type=float, default=None,
                    help="effective FLOP/s of the linear part, in GFLOP/s (default "
                    f"{DEFAULT_LINEAR_FLOPS / 1e9:g}: SmolLM2 on a 2-core CPU; set your own)")
    pf.add_argument("--attention-flops", type=float, default=None,
                    help="effective FLOP/s of attention, in GFLOP/s (default "
                    f"{DEFAULT_ATTENTION_FLOPS / 1e9:g}: SmolLM2 on a 2-core CPU)")
    pf.add_argument("--overhead-ms", type=float, default=None,
                    help=f"fixed per-request overhead in ms (default {DEFAULT_OVERHEAD_MS:g})")
    pf.add_argument("--attention-kernel", choices=KERNELS, default=None,
                    help="causal: skips masked pairs after cached tokens (FlashAttention, "
                    "vLLM, SGLang, kvpool's engine; default); masked: computes all (N-P)*N "
                    "pairs (PyTorch SDPA with a mask: transformers' stock sdpa path); "
                    "--measure's default: the kernel its engine runs")
    pf.add_argument("--measure", action="store_true",
                    help="fit the speeds on the reference engine here, then compare predicted "
                    "and measured TTFT at hits 0, 25, 50, 75, 90%%")
    pf.add_argument("--engine-attention", default="kvpool_causal",
                    choices=("kvpool_causal", "sdpa"),
                    help="--measure engine attention: kvpool_causal (the engine's default, "
                    "predicted as causal) or sdpa (the stock masked path, predicted as masked)")
    pf.add_argument("--model", default="smollm2",
                    help="engine model for --measure (default smollm2; must match CONFIG)")
    pf.add_argument("--repeats", type=int, default=3,
                    help="--measure rounds, each measuring every point once (default 3)")
    pf.add_argument("--threads", type=int, default=0,
                    help="torch threads for --measure (default 0 = torch's default)")
    pf.add_argument("--clock", default="wall", choices=("wall", "cpu"),
                    help="--measure TTFT clock: wall (default), or this thread's CPU time "
                    "to the first token (needs --threads 1; for a busy shared machine)")
    pf.add_argument("--stat", default="min", choices=("min", "median"),
                    help="--measure figure per point over the rounds (default min)")
    pf.add_argument("--out", default="kvpool-plan-measure",
                    help="--measure writes OUT.json and OUT.png (default kvpool-plan-measure)")
    pf.set_defaults(_plan=_run_prefill)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", metavar="CONFIG", help="config.json path or shipped config name")
    p.add_argument("--kv-dtype", default="bf16", choices=sorted(DTYPE_BYTES),
                   help="KV cache element type (default bf16)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks (default 1)")
    p.add_argument("--pp", type=int, default=1, help="pipeline-parallel stages (default 1)")
    p.add_argument("--page-size", type=int, default=16, help="tokens per page (default 16)")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")


def run(args: argparse.Namespace) -> int:
    """Dispatch to ``kv`` or ``prefill``; user mistakes raise UserError (cli prints it)."""
    return args._plan(args)


def _run_kv(args) -> int:
    plan = plan_kv(_load_spec(args.config), args.kv_dtype, tokens=args.tokens,
                   requests=args.requests, tp=args.tp, pp=args.pp, page_size=args.page_size,
                   state_dtype=args.state_dtype)
    print(json.dumps(plan.to_dict(), indent=2) if args.json else format_kv(plan))
    return 0


def format_kv(p: KVPlan) -> str:
    """Human-readable `plan kv` output."""
    ranks = f"TP {p.tp} x PP {p.pp}"
    lines = [f"model {p.model}  KV dtype {p.kv_dtype}  {ranks}  page {p.page_size} tokens",
             "layers:"]
    width = max([32] + [len(_kind_text(g)) for g in p.groups])
    lines += [_group_line(g, width) for g in p.groups]
    if p.state_per_request:
        lines.append(f"state dtype:  {p.state_dtype} (from {p.state_dtype_source}) for the "
                     f"recurrent state; conv state at the KV dtype {p.kv_dtype}")
    lines += [
        f"per token:    {_b(p.per_token)} total, {_b(p.per_token_rank)} per rank",
        f"per page:     {_b(p.per_page)} total, {_b(p.per_page_rank)} per rank",
        f"per request:  {_b(p.per_request)} total, {_b(p.per_request_rank)} per rank "
        f"({p.tokens} tokens" + (f", incl. {_b(p.state_per_request)} state" if
                                 p.state_per_request else "") + ")",
        f"pool:         {_b(p.pool)} total, {_b(p.pool_rank)} per rank, "
        f"{_b(p.pool_all_ranks)} over all {p.tp * p.pp} ranks with replicas "
        f"({p.requests} requests)",
    ]
    return "\n".join(lines)


_KIND_TEXT = {"full": "full attention", "sliding": "sliding window {w}",
              "chunked": "chunked attention {w}", "mla": "MLA latent (replicated over TP)",
              "linear": "linear attention ({m})", "mamba": "Mamba SSM ({m})",
              "ffn": "MLP/MoE only"}


def _kind_text(g) -> str:
    return _KIND_TEXT[g.kind].format(w=g.window, m=g.mixer)


def _group_line(g, width: int) -> str:
    what = _kind_text(g)
    parts = []
    if g.token_bytes:
        parts.append(f"{_b(g.token_bytes)}/token")
    if g.window_cap_bytes:
        parts.append(f"at most {_b(g.window_cap_bytes)}/request ({g.window} tokens)")
    if g.state_bytes:
        parts.append(f"{_b(g.state_bytes)}/request state (recurrent {_b(g.recurrent_bytes)}"
                     f" + conv {_b(g.conv_bytes)})")
    return f"  {g.count:3d} x {what:<{width}} layers {g.layers}: {', '.join(parts) or 'no cache'}"


def _b(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n:,} B ({n / size:.2f} {unit})"
    return f"{n:,} B"


def _run_prefill(args) -> int:
    spec = _load_spec(args.config)
    given = _rate_flags(args)
    if args.measure:
        return _run_measure(args, spec)
    link = _link(args)
    if link is not None:
        given["--bandwidth"] = (link.bandwidth / 1e9, "GB/s")
    defaulted = [flag for flag, (value, _) in given.items() if value is None]
    value = {flag: (_RATE_DEFAULTS[flag] if v is None else v) for flag, (v, _) in given.items()}
    rates = Rates(linear=value["--linear-flops"] * 1e9, attention=value["--attention-flops"] * 1e9,
                  overhead_s=value["--overhead-ms"] / 1e3, bandwidth=value["--bandwidth"] * 1e9,
                  attention_kernel=args.attention_kernel or "causal")
    report = prefill_report(spec, args.prompt, args.hit, rates, args.kv_dtype, args.tp, args.pp,
                            page_size=args.page_size)
    doc = {**report.to_dict(), "default_rates": defaulted}
    if link is not None:
        doc["link"] = _link_doc(spec, rates, link, args, report)
    if args.json:
        print(json.dumps(doc, indent=2))
    else:
        print(format_prefill(report, defaulted))
        if link is not None:
            print(_link_text(doc["link"]))
    return 0


MAX_CROSSOVER_PREFIX = 1 << 17  # tokens searched for the fetch/recompute crossover


def _link(args) -> Link | None:
    """The ``--link-gbit`` link, or None; UserError when --bandwidth is given too."""
    if args.link_gbit is None:
        return None
    if args.bandwidth is not None:
        raise UserError("give --bandwidth or --link-gbit, not both")
    return Link(args.link_gbit, args.link_delay_ms)


def _link_doc(spec, rates: Rates, link: Link, args, report: PrefillReport) -> dict:
    suffix = max(1, report.prompt - report.cached)
    cross = crossover(spec, rates, link, args.kv_dtype, suffix, MAX_CROSSOVER_PREFIX,
                      args.tp, args.pp)
    return {"gbit": link.gbit, "delay_ms": link.delay_ms, "payload_gbps": link.bandwidth / 1e9,
            "latency_ms": link.latency_s * 1e3, "suffix_tokens": suffix,
            "crossover_prefix_tokens": cross, "searched_up_to": MAX_CROSSOVER_PREFIX}


def _link_text(d: dict) -> str:
    head = (f"link {d['gbit']:g} Gbit/s ({d['payload_gbps']:.3g} GB/s TCP payload), "
            f"{d['delay_ms']:g} ms one way ({d['latency_ms']:.2f} ms of round trips per load)")
    if d["crossover_prefix_tokens"] is None:
        return (f"{head}: recomputing beats fetching for every prefix up to "
                f"{d['searched_up_to']} tokens (before {d['suffix_tokens']} new tokens)")
    return (f"{head}: fetching beats recomputing for prefixes of >= "
            f"{d['crossover_prefix_tokens']} tokens (before {d['suffix_tokens']} new tokens)")


# flag -> default in the flag's own unit (GFLOP/s, ms, GB/s)
_RATE_DEFAULTS = {"--linear-flops": DEFAULT_LINEAR_FLOPS / 1e9,
                  "--attention-flops": DEFAULT_ATTENTION_FLOPS / 1e9,
                  "--overhead-ms": DEFAULT_OVERHEAD_MS, "--bandwidth": DEFAULT_BANDWIDTH_GBPS}


def _rate_flags(args) -> dict[str, tuple[float | None, str]]:
    """The four rate flags as given (None = not given) with their unit; raises UserError
    naming the flag, the value as typed and its unit when one is out of range."""
    given = {"--linear-flops": (args.linear_flops, "GFLOP/s"),
             "--attention-flops": (args.attention_flops, "GFLOP/s"),
             "--overhead-ms": (args.overhead_ms, "ms"), "--bandwidth": (args.bandwidth, "GB/s")}
    for flag, (v, unit) in given.items():
        if v is None:
            continue
        zero_ok = flag == "--overhead-ms"
        in_range = (v >= 0 if zero_ok else v > 0) and v != float("inf")  # NaN fails too
        if not in_range:
            bound = ">= 0" if zero_ok else "> 0"
            raise UserError(f"{flag} must be a finite number {bound} {unit}, got {v:g} {unit}")
    return given


def format_prefill(r: PrefillReport, defaulted: list[str] = ()) -> str:
    """Human-readable `plan prefill` output; ``defaulted`` lists the rate flags that
    were not given, so the text says the prediction rests on the built-in rates."""
    rates = r.rates
    return "\n".join([
        f"model {r.model}  prompt {r.prompt} tokens  hit {r.hit:.0%} ({r.cached} cached)  "
        f"KV {r.kv_dtype}",
        f"rates assumed: linear {rates['linear'] / 1e9:g} GFLOP/s, attention "
        f"{rates['attention'] / 1e9:g} GFLOP/s, overhead {rates['overhead_s'] * 1e3:g} ms, "
        f"load {rates['bandwidth'] / 1e9:g} GB/s, {rates['attention_kernel']} attention kernel",
        *_defaults_note(defaulted),
        f"FLOPs cold: linear {r.flops_cold['linear']:.3e}  attention "
        f"{r.flops_cold['attention']:.3e}",
        f"FLOPs hit:  linear {r.flops_hit['linear']:.3e} ({r.linear_fraction_left:.0%})  "
        f"attention {r.flops_hit['attention']:.3e} ({r.attention_fraction_left:.0%})",
        f"ideal compute speedup: {r.ideal_speedup:.2f}x",
        f"TTFT cold: {r.ttft_cold_ms:.1f} ms   TTFT with hit: {r.ttft_hit_ms:.1f} ms "
        f"(overhead {r.ttft_hit_parts_ms['overhead']:.1f} + linear "
        f"{r.ttft_hit_parts_ms['linear']:.1f} + attention {r.ttft_hit_parts_ms['attention']:.1f}"
        f" + load {r.ttft_hit_parts_ms['load']:.1f})   predicted speedup "
        f"{r.predicted_speedup:.2f}x",
        f"load {r.load_bytes:,} B; break-even bandwidth {r.break_even_gbps:.3g} GB/s",
        "",
        r.explanation,
    ])


def _defaults_note(defaulted: list[str]) -> list[str]:
    if not defaulted:
        return []
    return [f"  NOTE: {', '.join(defaulted)} not given, so built-in rates measured for "
            "SmolLM2-135M on a 2-core CPU are used: the times below are for that machine, "
            "not yours.",
            "  Set --linear-flops and --attention-flops (GFLOP/s), --overhead-ms (ms) and "
            "--bandwidth (GB/s) for your hardware, or fit them here with --measure."]


def _run_measure(args, spec) -> int:
    import torch

    from kvpool.plan import measure

    check_at_least(args, 0, "threads")
    check_at_least(args, 1, "repeats")
    check_output_path("--out", args.out, make_folders=True)
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16",
             "bfloat16": "bfloat16", "fp16": "float16", "float16": "float16"}.get(args.kv_dtype)
    if dtype is None:
        raise UserError("--measure runs the engine in fp32, bf16 or fp16 (--kv-dtype)")
    meter = measure.EngineMeter(args.model, dtype=dtype, page_size=args.page_size,
                                max_prompt=args.prompt, clock=args.clock,
                                attention=args.engine_attention)
    measure.check_same_model(spec, meter.spec, args.kv_dtype)
    bandwidth = args.bandwidth * 1e9 if args.bandwidth is not None else None
    result = measure.run_measure(meter, args.prompt, repeats=args.repeats, bandwidth=bandwidth,
                                 stat=args.stat, kernel=args.attention_kernel)
    json_path, png_path = measure.write_outputs(result, args.out)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    fit = result.fit
    print(f"model {result.model}, prompt {result.prompt} tokens, torch threads {result.threads}, "
          f"{result.clock} clock, {result.stat} of {result.repeats} rounds")
    print("cold runs (ms): " + ", ".join(f"N={n}: {ms:.0f}" for n, ms in
                                         result.fit_runs_ms.items()))
    print(f"fit: linear {fit['linear_gflops']:.1f} GFLOP/s, attention "
          f"{fit['attention_gflops']:.1f} GFLOP/s, overhead {fit['overhead_ms']:.1f} ms "
          f"(worst error on the fit runs {fit['max_rel_error_on_fit_runs']:.1%})")
    print(f"load bandwidth {result.bandwidth_gbps:.2f} GB/s ({result.bandwidth_source}); "
          f"attention kernel {result.attention_kernel}")
    print(measure.format_table(result))
    verdict = "within" if result.within_tolerance else "NOT within"
    print(f"worst error {result.max_error:.1%}: {verdict} {measure.TOLERANCE:.0%}")
    print(f"wrote {json_path} and {png_path}")
    return 0
