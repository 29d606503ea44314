"""``kvpool bench``: one subcommand per benchmark module.

``store`` lives in :mod:`kvpool.bench.store`; ``cache`` in :mod:`kvpool.bench.cache`
(loaded only when used, so a missing or broken cache benchmark never blocks ``store``).
"""

from __future__ import annotations

import importlib

from kvpool.errors import UserError

HELP = "benchmarks: store (data path vs Mooncake/Redis/limits), cache (prefix cache)"

SUBCOMMANDS = {
    "store": ("kvpool.bench.store", "data path vs Mooncake Store, Redis and the machine's limits"),
    "cache": ("kvpool.bench.cache", "tiered prefix cache: TTFT and hit rates"),
}


def _load(module: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name != module:
            raise
        return None


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK")
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = _load(module)
        p = sub.add_parser(name, help=getattr(mod, "HELP", help_text),
                           description=getattr(mod, "HELP", help_text))
        if mod is None:
            p.set_defaults(_bench_missing=module)
            continue
        mod.add_arguments(p)
        p.set_defaults(_bench_run=mod.run)


def run(args) -> int:
    if getattr(args, "_bench_missing", None):
        raise UserError(f"benchmark {args.bench!r} is not available yet "
                        f"(module {args._bench_missing} is not installed in this build)")
    if not getattr(args, "_bench_run", None):
        raise UserError("choose a benchmark: kvpool bench store | kvpool bench cache "
                        "(see kvpool bench --help)")
    return args._bench_run(args)
