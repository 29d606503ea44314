"""The trace replay of ``kvpool bench cache``: a Mooncake request trace through the real
prefix cache.

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
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import time
from pathlib import Path
from collections.abc import Sequence

import numpy as np
import torch

from kvpool.bench.progress import progress_bar
from kvpool.bench.verdict import Verdict
from kvpool.cache import Namespace, PageChain, PrefixCache
from kvpool.errors import UserError

BLOCK_TOKENS = 512  # the Mooncake traces' block size
TRACE_NAME = "conversation_trace.jsonl"
AFFINITY_THRESHOLD = 0.5  # share of a prompt's blocks cached on an instance to follow it
PAGE_SHAPE = (1,)  # one byte per page: the replay measures hits, not bytes
NS = Namespace(model="trace-replay", dtype="uint8", page_size=BLOCK_TOKENS)


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
                 local_global: list[dict]) -> list[Verdict]:
    """Each FAST'25 claim on prefix caching with what this replay measured."""
    best = infinite.hit_rate
    by_cap = {r.tokens_per_instance: r.hit_rate for r in sweep}

    def share(cap: int) -> float | None:
        return by_cap[cap] / best if cap in by_cap and best else None

    claims = [Verdict("the conversation workload's prefix-caching ratio is about 40%", best, 0.40,
                      abs(best - 0.40) <= 0.05, f"theoretical max token hit rate {best:.1%}")]
    s3 = share(3_000_000)
    if s3 is not None:
        claims.append(Verdict("a 3M-token cache reaches less than half of the maximum", s3, 0.5,
                              s3 < 0.5, f"3e6 tokens: {by_cap[3_000_000]:.1%} = {s3:.0%} of max",
                              higher_is_better=False))
    s50 = share(50_000_000)
    if s50 is not None:
        claims.append(Verdict.bound("about 50M tokens of pooled capacity reach nearly all of it",
                                    s50, 0.9, f"5e7 tokens: {by_cap[50_000_000]:.1%} = {s50:.0%} of max"))
    if local_global:
        top = max(local_global, key=lambda r: r["ratio"])
        blind = max(local_global, key=lambda r: r["ratio_vs_load_only"])
        claims.append(Verdict.bound(
            "a global (pooled) cache raises the hit rate up to 2.36x over local caches",
            max(top["ratio"], blind["ratio_vs_load_only"]), 1.5,
            f"max ratio {top['ratio']:.2f}x over prefix-affinity-routed local "
            f"caches ({top['instances']} x {top['per_instance_tokens']:.0e} tokens); "
            f"{blind['ratio_vs_load_only']:.2f}x over load-only-routed ones "
            f"({blind['instances']} x {blind['per_instance_tokens']:.0e})"))
    return claims


# -- the whole replay and its report ----------------------------------------------------
def parse_capacities(text: str, what: str) -> list[int]:
    """Token capacities from "1e5,3e5" (``what``: the option, for the message);
    raises UserError unless each holds at least one block."""
    try:
        values = [int(float(v)) for v in text.split(",") if v.strip()]
    except ValueError:
        raise UserError(f"{what}: not a list of token counts: {text!r}") from None
    if any(v < BLOCK_TOKENS for v in values):
        raise UserError(f"{what}: every capacity must hold at least one {BLOCK_TOKENS}-token block")
    return values


def trace_replay(requests: list[TraceRequest], args, trace_name: str,
                 claims: bool = True) -> dict:
    """Replay ``requests`` at ``args.capacities`` and infinite capacity, then local vs
    global at ``args.local_capacities`` x ``args.instances``; the report as a dict, with
    the paper's claims checked unless ``claims`` is False (a trace not from the paper)."""
    capacities = parse_capacities(args.capacities, "--capacities")
    local_caps = parse_capacities(args.local_capacities, "--local-capacities")
    started = time.monotonic()
    builder = ChainBuilder()
    chains = [builder.chain(r) for r in requests]
    unique = len({k for c in chains for k in c.keys})
    runs = len(capacities) + 1 + 3 * len(local_caps)
    progress = progress_bar(runs * len(chains), args.no_progress)
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
        "claims": [v.as_claim() for v in check_claims(sweep, infinite, local_global)] if claims else [],
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


def _ratio(a: float, b: float) -> float:
    return a / b if b else math.inf


def print_replay(doc: dict) -> None:
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


def plot_replay(doc: dict, path: str) -> None:
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
