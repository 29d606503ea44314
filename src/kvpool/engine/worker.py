"""Engine worker: one reference engine in its own process, driven over a message channel.

Started as ``kvpool generate --worker [--master ADDR] ...``. It loads the model, builds a
PrefixCache (L1 in process; L3 = the kvpool store when ``--master`` is given), sends
Progress lines while it loads, then ``Ready(info={"model": {...}, "pid": N})``, and
answers each ``generate`` Request (:class:`kvpool.child.Request`) read from stdin; its
args are one of

    {"messages": [{"role": "user", "content": "..."}], "max_new_tokens": 24}
    {"prompt_ids": [1, 2, ...], "use_cache": false}

with a Reply whose result has the fields of :class:`~kvpool.engine.engine.GenerateResult`,
the prompt ids, the decoded answer, the logits in base64 and the cache's metrics; or an
Error. It exits at the end of stdin. Before replying it waits for the cache's L3
backups, so a page written by this request is visible to every other process once the
reply arrives.
"""

from __future__ import annotations

import os
import threading

from kvpool.child import Ready, WorkerChannel
from kvpool.engine.procs import encode_logits
from kvpool.errors import KVPoolError


def serve(args) -> int:
    """Run the worker loop until stdin ends. Returns the exit status (0)."""
    channel = WorkerChannel()
    engine, summary = start_engine(args, channel.progress)
    channel.send(Ready({"model": summary, "pid": os.getpid()}))
    channel.serve(lambda request: handle(engine, request.args),
                  (KVPoolError, ValueError, TypeError, KeyError))
    return 0


def start_engine(args, progress):
    """Load the model and attach a cache whose L3 is the store at ``args.master``."""
    import torch

    from kvpool.config import parse_size
    from kvpool.engine.engine import Engine
    from kvpool.engine.models import load_model, model_summary

    torch.set_num_threads(args.threads)
    l3, warming = None, None
    if args.master:  # connect first: an unreachable master fails before the model loads
        from kvpool.cache import StoreBackend
        from kvpool.client import Client

        client = Client(args.master, force_tcp=args.force_tcp)
        l3 = StoreBackend(client)
        warming = threading.Thread(target=_warm, args=(client,), name="kvpool-warm", daemon=True)
        warming.start()
    progress(f"loading model {args.model} ({args.dtype})")
    loaded = load_model(args.model, args.dtype, progress=progress)
    engine = Engine(loaded, attention=args.attention)
    engine.build_cache(args.page_size, parse_size(args.l1_size), l3=l3)
    engine.reserve(args.reserve_tokens)
    if warming is not None:
        warming.join()
    return engine, {**model_summary(loaded), "attention": engine.attention}


def _warm(client) -> None:
    """Fill the page tables of this host's segments while the model loads: a fresh
    process's first load out of a segment otherwise pays their page faults on the
    request's time to first token (the demo's cross-instance load of 102 MB took 244 ms
    without). Best effort: a failure only leaves the faults to the first load."""
    try:
        client.warm_local_segments()
    except (KVPoolError, OSError):
        pass


def handle(engine, request: dict) -> dict:
    """Serve one request dict (see module docstring); returns the result dict."""
    from kvpool.engine.workload import chat_prompt_ids

    if "prompt_ids" in request:
        prompt_ids = [int(t) for t in request["prompt_ids"]]
    else:
        prompt_ids = chat_prompt_ids(engine.loaded.tokenizer, request["messages"])
    result = engine.generate(prompt_ids, int(request.get("max_new_tokens", 32)),
                             use_cache=bool(request.get("use_cache", True)))
    if engine.cache is not None:
        engine.cache.flush()
    tokenizer = engine.loaded.tokenizer
    return {
        "prompt_ids": prompt_ids,
        "output_ids": result.output_ids,
        "text": tokenizer.decode(result.output_ids, skip_special_tokens=True)
        if tokenizer is not None else "",
        "prompt_tokens": result.prompt_tokens,
        "reused_tokens": result.reused_tokens,
        "reused_by_tier": result.reused_by_tier,
        "ttft_ms": result.ttft_ms,
        "decode_tok_s": result.decode_tok_s,
        "timings_ms": result.timings_ms,
        "last_logits": encode_logits(result.last_logits.numpy()),
        "cache_metrics": engine.cache.metrics.snapshot() if engine.cache is not None else {},
    }
