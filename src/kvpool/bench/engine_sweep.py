"""The engine sweep of ``kvpool bench cache --engine``: the reference engine (a real
model, CPU) on a workload of token ids (``chat``: multi-turn sessions; ``system``: one
shared system prompt, a distinct question per user), once per cache configuration
(L1/L2 sizes and write policies): TTFT and reuse per tier."""

from __future__ import annotations

import dataclasses

import numpy as np

from kvpool.bench.progress import progress_bar
from kvpool.cache import PrefixCache
from kvpool.errors import UserError

WORKLOADS = ("chat", "system")


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
    progress = progress_bar(args.repeats * len(configs) * len(prompts), args.no_progress)
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


def print_sweep(doc: dict) -> None:
    print(f"engine sweep: {doc['model']}, {doc['workload']} workload, {doc['requests']} "
          f"requests, page {doc['page_size']}, "
          f"working set {doc['working_set_pages']} pages")
    print(f"{'config':>34} {'L1':>5} {'L2':>5} {'hit':>6} {'mean TTFT':>10} {'p50':>8} "
          f"{'p99':>8}  by tier")
    for r in doc["configs"]:
        print(f"{r['name']:>34} {r['l1_pages']:>5} {r['l2_pages']:>5} {r['token_hit_rate']:>6.1%} "
              f"{r['mean_ttft_ms']:>8.1f}ms {r['p50_ttft_ms']:>6.1f}ms {r['p99_ttft_ms']:>6.1f}ms"
              f"  {r['reused_by_tier']}")


def plot_sweep(doc: dict, path: str) -> None:
    from kvpool.bench.plot import Panel, save_panels

    names = [r["name"] for r in doc["configs"]]
    save_panels(path, [
        Panel("mean TTFT", names, {"ms": [r["mean_ttft_ms"] for r in doc["configs"]]}, "ms"),
        Panel("token hit rate", names,
              {t: [100 * r["reused_by_tier"].get(t, 0) / max(1, sum(r["reused_by_tier"].values()))
                   * r["token_hit_rate"] for r in doc["configs"]] for t in ("L1", "L2")}, "%"),
    ], title=f"{doc['model']}, {doc['workload']} workload: L1/L2 sizes and write policies")


def check_sweep_args(args) -> None:
    """Raises UserError for sweep options out of range."""
    if min(args.sessions, args.turns, args.turn_tokens, args.new_tokens, args.page_size,
           args.repeats) < 1 or args.prefix_tokens < 0:
        raise UserError("--sessions, --turns, --turn-tokens, --new-tokens, --page-size and "
                        "--repeats must be >= 1")
