"""``kvpool bench cache``: replay a Mooncake request trace through the real prefix cache.

The trace format is that of the Mooncake FAST'25 release (``FAST25-release/traces``): one
JSON object per line with ``timestamp`` (ms), ``input_length``, ``output_length`` and
``hash_ids``, the remapped prefix-block hashes of 512-token blocks. Each hash id becomes a
deterministic block of token ids (``id * 512 + j``), keys are chained by
:func:`kvpool.cache.keys.chain_keys` exactly as for real prompts, and every request goes
through ``PrefixCache.match`` / ``insert`` (LRU eviction in the radix tree) with tiny
synthetic page payloads: no model runs. Only full blocks are cached.

Reported (token hit rate = matched prompt tokens / all prompt tokens):

- hit rate vs pooled capacity (one cache of C tokens), and with infinite capacity (the
  theoretical maximum prefix hit rate of the trace);
- local vs global: N instances each with C tokens and prefix-affinity routing (to the
  instance caching the longest prefix if it covers at least half of the prompt, else to
  the least loaded), and the same with load-only routing, against one pooled cache of N*C;
- the paper's claims (section 5.2.1 / 5.3.1), each with the replay's numbers.

``--engine`` instead runs the reference engine (a real model, CPU) on a workload of token
ids (``--workload chat``: multi-turn sessions; ``system``: one shared system prompt, a
distinct question per user) and sweeps L1/L2 sizes and write policies: TTFT and reuse per
tier. ``--quick`` runs both workloads with few short requests, then replays a small
generated trace: a smoke run of every path in under two minutes (about 30 s with
SmolLM2 on 2 CPU cores).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import sys
import time
from pathlib import Path
from collections.abc import Sequence

import numpy as np
import torch

from kvpool.cache import Namespace, PageChain, PrefixCache
from kvpool.errors import UserError

HELP = "prefix cache trace replay: token hit rate vs pooled capacity, local vs global caches"

BLOCK_TOKENS = 512  # the Mooncake traces' block size
TRACE_NAME = "conversation_trace.jsonl"
DEFAULT_CAPACITIES = "1e5,3e5,1e6,3e6,1e7,3e7,5e7,1e8"
DEFAULT_LOCAL = "1e5,3e5,1e6,3e6,1e7"
AFFINITY_THRESHOLD = 0.5  # share of a prompt's blocks cached on an instance to follow it
PAGE_SHAPE = (1,)  # one byte per page: the replay measures hits, not bytes
NS = Namespace(model="trace-replay", dtype="uint8", page_size=BLOCK_TOKENS)
WORKLOADS = ("chat", "system")
# --quick: what replaces each option left at its parser default (a small engine sweep on
# the same model, then a replay of a generated trace of QUICK_TRACE sessions x turns)
QUICK = {"sessions": 2, "turns": 2, "prefix_tokens": 64,
         "turn_tokens": 32, "new_tokens": 2, "repeats": 1, "capacities": "1024,4096,1e6",
         "local_capacities": "2048,1e5", "instances": 3, "json_path": "cache_quick.json",
         "plot_path": "cache_quick.png"}
QUICK_TRACE = (12, 5)


@dataclasses.dataclass(frozen=True)
class TraceRequest:
    """One request of a trace: arrival (ms), prompt length (tokens), prefix-block ids."""

    timestamp: int
    input_length: int
    hash_ids: tuple[int, ...]


@dataclasses.dataclass
class ReplayResult:
    """Hits of one replay configuration."""

    instances: int
    tokens_per_instance: int | None   # None: infinite
    hit_tokens: int
    input_tokens: int
    evictions: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0


# -- trace ------------------------------------------------------------------------------
def default_trace() -> str:
    """``$KVPOOL_TRACE``, else the conversation trace in the ``shared/traces`` folder that
    sits beside the repository (as on developer machines and in CI)."""
    from kvpool.config import env

    chosen = env("trace")
    if chosen:
        return chosen
    repo = Path(__file__).resolve().parents[3]
    return str(repo.parent / "shared" / "traces" / TRACE_NAME)


def load_trace(path: str, limit: int | None = None) -> list[TraceRequest]:
    """Read a Mooncake trace (JSON lines). Raises UserError for a missing file or bad line."""
    if not os.path.isfile(path):
        raise UserError(f"trace file not found: {path}")
    requests = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                req = TraceRequest(int(obj["timestamp"]), int(obj["input_length"]),
                                   tuple(int(h) for h in obj["hash_ids"]))
            except (ValueError, KeyError, TypeError) as exc:
                raise UserError(f"{path}:{lineno}: not a trace record ({exc})") from None
            if req.input_length < 0 or any(h < 0 for h in req.hash_ids):
                raise UserError(f"{path}:{lineno}: negative length or hash id")
            requests.append(req)
            if limit is not None and len(requests) >= limit:
                break
    if not requests:
        raise UserError(f"trace {path} has no requests")
    return requests


class ChainBuilder:
    """Page chains of trace requests: hash id ``h`` stands for the token ids
    ``h*512 .. h*512+511``; keys are memoised per (parent key, id), so each block is
    hashed once however often it recurs."""

    def __init__(self, ns: Namespace = NS):
        self.ns_digest = ns.digest()
        self.block = ns.page_size
        self._tokens: dict[int, bytes] = {}
        self._keys: dict[tuple[bytes, int], bytes] = {}

    def tokens(self, hash_id: int) -> bytes:
        """The uint32-LE token bytes of block ``hash_id``."""
        data = self._tokens.get(hash_id)
        if data is None:
            first = hash_id * self.block
            if first + self.block > 2**32:
                raise UserError(f"hash id {hash_id} is too large for 32-bit token ids")
            data = (np.arange(self.block, dtype="<u4") + np.uint32(first)).tobytes()
            self._tokens[hash_id] = data
        return data

    def chain(self, req: TraceRequest) -> PageChain:
        """The chain of the request's full blocks (a partial last block is not cached)."""
        full = min(len(req.hash_ids), req.input_length // self.block)
        keys, toks, prev = [], [], self.ns_digest
        for hash_id in req.hash_ids[:full]:
            key = self._keys.get((prev, hash_id))
            if key is None:
                key = hashlib.sha256(prev + self.tokens(hash_id)).digest()
                self._keys[(prev, hash_id)] = key
            keys.append(key)
            toks.append(self.tokens(hash_id))
            prev = key
        return PageChain(self.ns_digest, tuple(keys), tuple(toks), req.input_length)


# -- replay -----------------------------------------------------------------------------
def replay(chains: Sequence[PageChain], instances: int, tokens_per_instance: int | None,
           unique_pages: int, progress=None, affinity: bool = True) -> ReplayResult:
    """Replay ``chains`` in order on ``instances`` caches of ``tokens_per_instance`` each
    (None: large enough never to evict), routed by :func:`_route` (``affinity=False``:
    to the least loaded instance only, blind to what each caches)."""
    pages = (unique_pages + 1 if tokens_per_instance is None
             else max(1, tokens_per_instance // BLOCK_TOKENS))
    caches = [PrefixCache(NS, PAGE_SHAPE, torch.uint8, l1_pages=pages) for _ in range(instances)]
    load = [0] * instances
    longest = max(len(c.keys) for c in chains)
    payload = torch.zeros((longest, *PAGE_SHAPE), dtype=torch.uint8)
    hits = total = 0
    for chain in chains:
        cache = caches[_route(caches, load, chain, affinity)]
        m = cache.match(chain)
        hits += m.num_tokens
        total += chain.num_tokens
        cache.release(m)
        cache.insert(chain, payload[:len(chain.keys)])
        if progress is not None:
            progress.update(1)
    evictions = sum(c.metrics["evictions_l1"] for c in caches)
    return ReplayResult(instances, tokens_per_instance, hits, total, evictions)


def _route(caches: list[PrefixCache], load: list[int], chain: PageChain,
           affinity: bool = True) -> int:
    """Prefix-affinity routing in the style of SGLang's cache-aware router: the instance
    with the longest cached prefix when it covers at least AFFINITY_THRESHOLD of the
    prompt's blocks, else the least loaded one (requests routed so far)."""
    n = len(caches)
    if n == 1:
        return 0
    cached = [c.peek(chain) if affinity else 0 for c in caches]
    best = max(range(n), key=lambda i: (cached[i], -load[i], -i))
    if not chain.keys or cached[best] < AFFINITY_THRESHOLD * len(chain.keys):
        best = min(range(n), key=lambda i: (load[i], i))
    load[best] += 1
    return best


# -- the paper's claims -----------------------------------------------------------------
def check_claims(sweep: list[ReplayResult], infinite: ReplayResult,
                 local_global: list[dict]) -> list[dict]:
    """Each FAST'25 claim on prefix caching with what this replay measured."""
    best = infinite.hit_rate
    by_cap = {r.tokens_per_instance: r.hit_rate for r in sweep}

    def share(cap: int) -> float | None:
        return by_cap[cap] / best if cap in by_cap and best else None

    claims = [{
        "claim": "the conversation workload's prefix-caching ratio is about 40%",
        "measured": f"theoretical max token hit rate {best:.1%}",
        "holds": abs(best - 0.40) <= 0.05,
    }]
    s3 = share(3_000_000)
    if s3 is not None:
        claims.append({"claim": "a 3M-token cache reaches less than half of the maximum",
                       "measured": f"3e6 tokens: {by_cap[3_000_000]:.1%} = {s3:.0%} of max",
                       "holds": s3 < 0.5})
    s50 = share(50_000_000)
    if s50 is not None:
        claims.append({"claim": "about 50M tokens of pooled capacity reach nearly all of it",
                       "measured": f"5e7 tokens: {by_cap[50_000_000]:.1%} = {s50:.0%} of max",
                       "holds": s50 >= 0.9})
    if local_global:
        top = max(local_global, key=lambda r: r["ratio"])
        blind = max(local_global, key=lambda r: r["ratio_vs_load_only"])
        claims.append({
            "claim": "a global (pooled) cache raises the hit rate up to 2.36x over local caches",
            "measured": (f"max ratio {top['ratio']:.2f}x over prefix-affinity-routed local "
                         f"caches ({top['instances']} x {top['per_instance_tokens']:.0e} tokens); "
                         f"{blind['ratio_vs_load_only']:.2f}x over load-only-routed ones "
                         f"({blind['instances']} x {blind['per_instance_tokens']:.0e})"),
            "holds": max(top["ratio"], blind["ratio_vs_load_only"]) >= 1.5,
        })
    return claims


# -- model-based sweep (reference engine) ------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TierConfig:
    """One cache configuration of the engine sweep (0 L1 pages: no cache at all)."""

    name: str
    l1_pages: int
    l2_pages: int = 0
    write_policy: str = "write_through"


def session_prompts(sessions: int, turns: int, prefix_tokens: int, turn_tokens: int,
                    vocab: int, seed: int = 0) -> list[list[int]]:
    """Multi-turn sessions as token ids: a shared system prefix, then each turn appends
    ``turn_tokens`` to its session; turns of all sessions interleave (turn-major)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, prefix_tokens).tolist()
    history = [list(system) for _ in range(sessions)]
    prompts = []
    for _ in range(turns):
        for s in range(sessions):
            history[s] += rng.integers(0, vocab, turn_tokens).tolist()
            prompts.append(list(history[s]))
    return prompts


def system_prompt_prompts(users: int, prefix_tokens: int, question_tokens: int, vocab: int,
                          seed: int = 0) -> list[list[int]]:
    """One system prompt of ``prefix_tokens`` shared by every request, each followed by a
    distinct question of ``question_tokens`` (one request per user)."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, vocab, prefix_tokens).tolist()
    return [system + rng.integers(0, vocab, question_tokens).tolist() for _ in range(users)]


def workload_prompts(args, vocab: int) -> tuple[list[list[int]], int]:
    """The prompts of ``args.workload`` and their working set in pages (every distinct
    page once): chat = sessions x turns; system = sessions * turns single questions."""
    if args.workload == "system":
        users = args.sessions * args.turns
        prompts = system_prompt_prompts(users, args.prefix_tokens, args.turn_tokens, vocab)
        return prompts, args.prefix_tokens // args.page_size + users * (
            (args.prefix_tokens + args.turn_tokens) // args.page_size
            - args.prefix_tokens // args.page_size)
    prompts = session_prompts(args.sessions, args.turns, args.prefix_tokens, args.turn_tokens,
                              vocab)
    return prompts, (args.prefix_tokens
                     + args.sessions * args.turns * args.turn_tokens) // args.page_size


def tier_configs(working_pages: int) -> list[TierConfig]:
    """Cold, a roomy L1, and a quarter-size L1 alone and with an L2 under each policy."""
    small = max(2, working_pages // 4)
    roomy = working_pages + 1
    return [TierConfig("no cache", 0), TierConfig("L1 roomy", roomy),
            TierConfig("L1 small", small)] + [
        TierConfig(f"L1 small + L2 {p}", small, roomy, p)
        for p in ("write_through", "write_through_selective", "write_back")]


def engine_sweep(args, engine=None) -> dict:
    """Run ``args.workload`` once per TierConfig on the reference engine (loaded from
    ``args.model`` unless given)."""
    if engine is None:
        from kvpool.engine.engine import Engine  # lazily: the trace replay needs no model

        engine = Engine(args.model, dtype="float32")
    vocab = engine.model.get_input_embeddings().num_embeddings
    prompts, working = workload_prompts(args, vocab)
    engine.generate(prompts[0][:32], max_new_tokens=1, use_cache=False)  # warm the kernels
    configs = tier_configs(working)
    progress = _progress(args.repeats * len(configs) * len(prompts), args.no_progress)
    # repeats outside, configs inside: background load hits every config alike; each
    # request's TTFT is the minimum over repeats (the least disturbed run)
    runs = [[_engine_run(engine, cfg, prompts, args, progress) for cfg in configs]
            for _ in range(args.repeats)]
    if progress is not None:
        progress.close()
    rows = []
    for i, cfg in enumerate(configs):
        row = runs[0][i]
        ttfts = np.min([run[i].pop("ttfts_ms") for run in runs], axis=0)
        row.update(mean_ttft_ms=float(ttfts.mean()), p50_ttft_ms=float(np.median(ttfts)),
                   p99_ttft_ms=float(np.percentile(ttfts, 99)))
        rows.append(row)
    return {"model": engine.loaded.name, "workload": args.workload,
            "page_size": args.page_size, "requests": len(prompts),
            "repeats": args.repeats, "working_set_pages": working, "configs": rows}


def _engine_run(engine, cfg: TierConfig, prompts: list[list[int]], args, progress) -> dict:
    cache = None
    if cfg.l1_pages:
        cache = PrefixCache(engine.namespace(args.page_size), engine.page_shape(args.page_size),
                            engine.model.dtype, l1_pages=cfg.l1_pages, l2_pages=cfg.l2_pages,
                            write_policy=cfg.write_policy)
    engine.cache = cache
    ttfts, by_tier, reused, total = [], {}, 0, 0
    try:
        for prompt in prompts:
            r = engine.generate(prompt, max_new_tokens=args.new_tokens, use_cache=cache is not None)
            ttfts.append(r.ttft_ms)
            reused += r.reused_tokens
            total += r.prompt_tokens
            for tier, n in r.reused_by_tier.items():
                by_tier[tier] = by_tier.get(tier, 0) + n
            if progress is not None:
                progress.update(1)
        counters = cache.metrics.snapshot() if cache is not None else {}
    finally:
        engine.cache = None
        if cache is not None:
            cache.close()
    return {**dataclasses.asdict(cfg), "ttfts_ms": ttfts, "token_hit_rate": reused / total,
            "reused_by_tier": by_tier, "l2_writes": counters.get("l2_writes", 0),
            "evictions_l1": counters.get("evictions_l1", 0),
            "evictions_l2": counters.get("evictions_l2", 0)}


def _print_engine(doc: dict) -> None:
    print(f"engine sweep: {doc['model']}, {doc['workload']} workload, {doc['requests']} "
          f"requests, page {doc['page_size']}, "
          f"working set {doc['working_set_pages']} pages")
    print(f"{'config':>34} {'L1':>5} {'L2':>5} {'hit':>6} {'mean TTFT':>10} {'p50':>8} "
          f"{'p99':>8}  by tier")
    for r in doc["configs"]:
        print(f"{r['name']:>34} {r['l1_pages']:>5} {r['l2_pages']:>5} {r['token_hit_rate']:>6.1%} "
              f"{r['mean_ttft_ms']:>8.1f}ms {r['p50_ttft_ms']:>6.1f}ms {r['p99_ttft_ms']:>6.1f}ms"
              f"  {r['reused_by_tier']}")


def _plot_engine(doc: dict, path: str) -> None:
    from kvpool.bench.plot import Panel, save_panels

    names = [r["name"] for r in doc["configs"]]
    save_panels(path, [
        Panel("mean TTFT", names, {"ms": [r["mean_ttft_ms"] for r in doc["configs"]]}, "ms"),
        Panel("token hit rate", names,
              {t: [100 * r["reused_by_tier"].get(t, 0) / max(1, sum(r["reused_by_tier"].values()))
                   * r["token_hit_rate"] for r in doc["configs"]] for t in ("L1", "L2")}, "%"),
    ], title=f"{doc['model']}, {doc['workload']} workload: L1/L2 sizes and write policies")


# -- CLI --------------------------------------------------------------------------------
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


def _capacities(text: str, what: str) -> list[int]:
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what}: not a list of token counts: {text!r}") from None
    if any(v < BLOCK_TOKENS for v in values):
        raise UserError(f"{what}: every capacity must hold at least one {BLOCK_TOKENS}-token block")
    return values


def run(args) -> int:
    torch.set_num_threads(1)
    if args.quick:
        return _run_quick(args)
    if args.engine:
        return _run_engine(args)
    _check_replay_args(args)
    args.trace = args.trace or default_trace()
    doc = trace_replay(load_trace(args.trace, args.limit), args, os.path.abspath(args.trace))
    _print(doc)
    _write(doc, args.json_path)
    if args.plot_path:
        _plot(doc, args.plot_path)
    return 0


def _check_replay_args(args) -> None:
    _capacities(args.capacities, "--capacities")
    _capacities(args.local_capacities, "--local-capacities")
    if args.instances < 1:
        raise UserError("--instances must be >= 1")


def trace_replay(requests: list[TraceRequest], args, trace_name: str,
                 claims: bool = True) -> dict:
    """Replay ``requests`` at ``args.capacities`` and infinite capacity, then local vs
    global at ``args.local_capacities`` x ``args.instances``; the report as a dict, with
    the paper's claims checked unless ``claims`` is False (a trace not from the paper)."""
    capacities = _capacities(args.capacities, "--capacities")
    local_caps = _capacities(args.local_capacities, "--local-capacities")
    started = time.monotonic()
    builder = ChainBuilder()
    chains = [builder.chain(r) for r in requests]
    unique = len({k for c in chains for k in c.keys})
    runs = len(capacities) + 1 + 3 * len(local_caps)
    progress = _progress(runs * len(chains), args.no_progress)
    sweep = [replay(chains, 1, cap, unique, progress) for cap in capacities]
    infinite = replay(chains, 1, None, unique, progress)
    local_global = []
    for cap in local_caps:
        local = replay(chains, args.instances, cap, unique, progress)
        blind = replay(chains, args.instances, cap, unique, progress, affinity=False)
        pooled = replay(chains, 1, cap * args.instances, unique, progress)
        local_global.append({
            "instances": args.instances, "per_instance_tokens": cap,
            "local_hit_rate": local.hit_rate, "local_load_only_hit_rate": blind.hit_rate,
            "global_hit_rate": pooled.hit_rate,
            "ratio": _ratio(pooled.hit_rate, local.hit_rate),
            "ratio_vs_load_only": _ratio(pooled.hit_rate, blind.hit_rate),
        })
    if progress is not None:
        progress.close()
    return {
        "trace": trace_name,
        "requests": len(requests),
        "input_tokens": infinite.input_tokens,
        "unique_blocks": unique,
        "block_tokens": BLOCK_TOKENS,
        "capacity_sweep": [{"capacity_tokens": r.tokens_per_instance, "hit_rate": r.hit_rate,
                            "hit_rate_of_max": r.hit_rate / infinite.hit_rate
                            if infinite.hit_rate else None,
                            "evictions": r.evictions} for r in sweep],
        "infinite": {"hit_rate": infinite.hit_rate},
        "local_vs_global": local_global,
        "claims": check_claims(sweep, infinite, local_global) if claims else [],
        "elapsed_s": round(time.monotonic() - started, 1),
    }


def generated_trace(sessions: int, turns: int, seed: int = 0) -> list[TraceRequest]:
    """A Mooncake-style conversation trace: one shared system block, then each turn extends
    its session's prefix by 1-2 fresh blocks (ids unique per prefix, as in the real traces);
    sessions interleave in random order within a turn."""
    rng = np.random.default_rng(seed)
    next_id, requests = 1, []
    history = {s: [0] for s in range(sessions)}
    for turn in range(turns):
        for s in rng.permutation(sessions).tolist():
            grow = int(rng.integers(1, 3))
            history[s] += range(next_id, next_id + grow)
            next_id += grow
            ids = tuple(history[s])
            requests.append(TraceRequest(turn * 1000, BLOCK_TOKENS * len(ids)
                                         - int(rng.integers(0, 300)), ids))
    return requests


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
    _check_engine_args(args)
    _check_replay_args(args)
    from kvpool.engine.engine import Engine

    started = time.monotonic()
    engine = Engine(args.model, dtype="float32")
    doc = {"quick": True, "engine": {}}
    for workload in WORKLOADS:
        args.workload = workload
        doc["engine"][workload] = engine_sweep(args, engine)
        _print_engine(doc["engine"][workload])
    if args.trace:  # the user's trace, cut by --limit
        requests, name = load_trace(args.trace, args.limit), os.path.abspath(args.trace)
    else:
        sessions, turns = QUICK_TRACE
        requests = generated_trace(sessions, turns)
        name = f"generated: {sessions} sessions x {turns} turns"
    doc["trace"] = trace_replay(requests, args, name, claims=bool(args.trace))
    _print(doc["trace"])
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    print(f"quick run: {doc['elapsed_s']} s")
    _write(doc, args.json_path)
    if args.plot_path:
        stem = Path(args.plot_path)
        for workload in WORKLOADS:
            _plot_engine(doc["engine"][workload], str(stem.with_stem(f"{stem.stem}_{workload}")))
        _plot(doc["trace"], str(stem.with_stem(f"{stem.stem}_trace")))
    return 0


def _write(doc: dict, path: str) -> None:
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def _check_engine_args(args) -> None:
    if min(args.sessions, args.turns, args.turn_tokens, args.new_tokens, args.page_size,
           args.repeats) < 1 or args.prefix_tokens < 0:
        raise UserError("--sessions, --turns, --turn-tokens, --new-tokens, --page-size and "
                        "--repeats must be >= 1")


def _run_engine(args) -> int:
    _check_engine_args(args)
    started = time.monotonic()
    doc = engine_sweep(args)
    doc["elapsed_s"] = round(time.monotonic() - started, 1)
    _print_engine(doc)
    _write(doc, args.json_path)
    if args.plot_path:
        _plot_engine(doc, args.plot_path)
    return 0


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def _progress(total: int, disabled: bool):
    if disabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", desc="replay", file=sys.stderr, mininterval=0.5)


def _print(doc: dict) -> None:
    print(f"trace {doc['trace']}: {doc['requests']} requests, {doc['input_tokens']} prompt "
          f"tokens, {doc['unique_blocks']} distinct blocks")
    print(f"{'capacity (tokens)':>18} {'hit rate':>9} {'of max':>7}")
    for r in doc["capacity_sweep"]:
        print(f"{r['capacity_tokens']:>18.0e} {r['hit_rate']:>9.1%} {r['hit_rate_of_max']:>7.0%}")
    print(f"{'infinite':>18} {doc['infinite']['hit_rate']:>9.1%} {'100%':>7}")
    for r in doc["local_vs_global"]:
        print(f"{r['instances']} x {r['per_instance_tokens']:.0e} tokens: local affinity "
              f"{r['local_hit_rate']:.1%}, local load-only {r['local_load_only_hit_rate']:.1%}, "
              f"global {r['global_hit_rate']:.1%}, ratio {r['ratio']:.2f}x / "
              f"{r['ratio_vs_load_only']:.2f}x")
    for c in doc["claims"]:
        print(f"[{'holds' if c['holds'] else 'DIFFERS'}] {c['claim']}: {c['measured']}")
    print(f"elapsed {doc['elapsed_s']} s")


def _plot(doc: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    caps = [r["capacity_tokens"] for r in doc["capacity_sweep"]]
    ax1.plot(caps, [100 * r["hit_rate"] for r in doc["capacity_sweep"]], "o-", label="pooled LRU")
    ax1.axhline(100 * doc["infinite"]["hit_rate"], color="grey", ls="--", label="infinite (max)")
    ax1.set_xscale("log")
    ax1.set_xlabel("cache capacity (tokens)")
    ax1.set_ylabel("token hit rate (%)")
    ax1.set_title("hit rate vs pooled capacity")
    ax1.legend()
    ax1.grid(alpha=0.3)
    lg = doc["local_vs_global"]
    if lg:
        per = [r["per_instance_tokens"] for r in lg]
        ax2.plot(per, [100 * r["local_hit_rate"] for r in lg], "o-",
                 label=f"local, prefix-affinity ({lg[0]['instances']} instances)")
        ax2.plot(per, [100 * r["local_load_only_hit_rate"] for r in lg], "^-",
                 label="local, load-only routing")
        ax2.plot(per, [100 * r["global_hit_rate"] for r in lg], "s-", label="global (pooled)")
        for x, r in zip(per, lg):
            ax2.annotate(f"{r['ratio']:.2f}x / {r['ratio_vs_load_only']:.2f}x",
                         (x, 100 * r["global_hit_rate"]),
                         textcoords="offset points", xytext=(0, 6), ha="center", fontsize=8)
        ax2.set_xscale("log")
        ax2.set_xlabel("capacity per instance (tokens)")
        ax2.set_ylabel("token hit rate (%)")
        ax2.set_title("local vs global cache")
        ax2.legend()
        ax2.grid(alpha=0.3)
    fig.suptitle(os.path.basename(doc["trace"]))
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
