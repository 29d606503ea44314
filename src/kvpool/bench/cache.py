"""``kvpool bench cache``: the prefix-cache benchmarks, one program each.

By default a Mooncake request trace is replayed through the real prefix cache
(:mod:`kvpool.bench.trace_replay`: hit rate vs pooled capacity, local vs global, the
paper's claims).

``--engine`` instead (:mod:`kvpool.bench.engine_sweep`) runs the reference engine (a real model, CPU) on a workload of token
ids (``--workload chat``: multi-turn sessions; ``system``: one shared system prompt, a
distinct question per user) and sweeps L1/L2 sizes and write policies: TTFT and reuse per
tier. ``--quick`` runs both workloads with few short requests, then replays a small
generated trace: a smoke run of every path in under two minutes (about 30 s with
SmolLM2 on 2 CPU cores).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from kvpool.bench.engine_sweep import WORKLOADS, check_sweep_args, engine_sweep, plot_sweep, print_sweep
from kvpool.bench.trace_replay import (
    TRACE_NAME, default_trace, generated_trace, load_trace, parse_capacities, plot_replay,
    print_replay, trace_replay,
)
from kvpool.errors import UserError

HELP = "prefix cache trace replay: token hit rate vs pooled capacity, local vs global caches"

DEFAULT_CAPACITIES = "1e5,3e5,1e6,3e6,1e7,3e7,5e7,1e8"
DEFAULT_LOCAL = "1e5,3e5,1e6,3e6,1e7"
# --quick: what replaces each option left at its parser default (a small engine sweep on
# the same model, then a replay of a generated trace of QUICK_TRACE sessions x turns)
QUICK = {"sessions": 2, "turns": 2, "prefix_tokens": 64,
         "turn_tokens": 32, "new_tokens": 2, "repeats": 1, "capacities": "1024,4096,1e6",
         "local_capacities": "2048,1e5", "instances": 3, "json_path": "cache_quick.json",
         "plot_path": "cache_quick.png"}
QUICK_TRACE = (12, 5)


def add_arguments(p) -> None:
    p.add_argument("--trace", default=None,
                   help="Mooncake trace, JSON lines (default $KVPOOL_TRACE, else "
                        f"shared/traces/{TRACE_NAME} beside the repository)")
    p.add_argument("--capacities", default=DEFAULT_CAPACITIES,
                   help=f"pooled capacities in tokens (default {DEFAULT_CAPACITIES}); "
                        "infinite is always added")
    p.add_argument("--instances", type=int, default=8, help="instances for local vs global")
    p.add_argument("--local-capacities", default=DEFAULT_LOCAL,
                   help=f"tokens per instance for local vs global (default {DEFAULT_LOCAL}; "
                        "'' to skip)")
    p.add_argument("--limit", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--json", dest="json_path", default="cache_trace.json",
                   help="write results as JSON here (default cache_trace.json)")
    p.add_argument("--plot", dest="plot_path", default="cache_trace.png",
                   help="write a PNG plot here (default cache_trace.png; '' for none)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    g = p.add_argument_group("model-based sweep (--engine)")
    g.add_argument("--engine", action="store_true",
                   help="sweep L1/L2 sizes and write policies on the reference engine instead")
    g.add_argument("--workload", choices=WORKLOADS, default="chat",
                   help="chat: multi-turn sessions on a shared prefix (default); system: one "
                        "shared system prompt, a distinct question per user")
    g.add_argument("--model", default="smollm2", help="engine model (default smollm2)")
    g.add_argument("--sessions", type=int, default=4, help="concurrent sessions (default 4)")
    g.add_argument("--turns", type=int, default=3, help="turns per session (default 3)")
    g.add_argument("--prefix-tokens", type=int, default=128, help="shared system prefix")
    g.add_argument("--turn-tokens", type=int, default=48, help="tokens each turn appends")
    g.add_argument("--new-tokens", type=int, default=4, help="tokens generated per request")
    g.add_argument("--page-size", type=int, default=16, help="tokens per page")
    g.add_argument("--repeats", type=int, default=2,
                   help="runs of the whole sweep; TTFT per request is the minimum (default 2)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run in under 2 minutes: both engine workloads with few short "
                        "requests, then a small generated trace (or --trace with --limit); an "
                        "option set to other than its default keeps that value (writes "
                        "cache_quick.json and cache_quick_{chat,system,trace}.png)")


def run(args) -> int:
    torch.set_num_threads(1)
    if args.quick:
        return _run_quick(args)
    if args.engine:
        return _run_engine(args)
    _check_replay_args(args)
    args.trace = args.trace or default_trace()
    doc = trace_replay(load_trace(args.trace, args.limit), args, os.path.abspath(args.trace))
    print_replay(doc)
    _write(doc, args.json_path)
    if args.plot_path:
        plot_replay(doc, args.plot_path)
    return 0


def _check_replay_args(args) -> None:
    parse_capacities(args.capacities, "--capacities")
    parse_capacities(args.local_capacities, "--local-capacities")
    if args.instances < 1:
        raise UserError("--instances must be >= 1")


def _apply_quick(args) -> None:
    """Replace each option still at its parser default by its QUICK value."""
    import argparse

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    defaults = vars(parser.parse_args([]))
    for name, value in QUICK.items():
        if getattr(args, name) == defaults[name]:
            setattr(args, name, value)


def _run_quick(args) -> int:
    """Both engine workloads on one loaded model, then the replay of a generated trace
    (``--trace``: that one); one JSON, one PNG per part (``<plot stem>_<part>.png``)."""
    _apply_quick(args)
    check_sweep_args(args)
    _check_replay_args(args)
    from kvpool.engine.engine import Engine

    started = time.monotonic()
    engine = Engine(args.model, dtype="float32")
    doc = {"quick": True, "engine": {}}
    for workload in WORKLOADS:
        args.workload = workload
        doc["engine"][workload] = engine_sweep(args, engine)
        print_sweep(doc["engine"][workload])
    if args.trace:  # the user's trace, cut by --limit
        requests, name = load_trace(args.trace, args.limit), os.path.abspath(args.trace)
    else:
        sessions, turns = QUICK_TRACE
        requests = generated_trace(sessions, turns)
        name = f"generated: {sessions} sessions x {turns} turns"
    doc["trace"] = trace_replay(requests, args, name, claims=bool(args.trace))
    print_replay(doc["trace"])
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    print(f"quick run: {doc['elapsed_s']} s")
    _write(doc, args.json_path)
    if args.plot_path:
        stem = Path(args.plot_path)
        for workload in WORKLOADS:
            plot_sweep(doc["engine"][workload], str(stem.with_stem(f"{stem.stem}_{workload}")))
        plot_replay(doc["trace"], str(stem.with_stem(f"{stem.stem}_trace")))
    return 0


def _write(doc: dict, path: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def _run_engine(args) -> int:
    check_sweep_args(args)
    started = time.monotonic()
    doc = engine_sweep(args)
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    print_sweep(doc)
    _write(doc, args.json_path)
    if args.plot_path:
        plot_sweep(doc, args.plot_path)
    return 0
