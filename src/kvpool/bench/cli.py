"""``kvpool bench``: one subcommand per benchmark module, imported only when chosen.

``store`` lives in :mod:`kvpool.bench.store`, ``cache`` in :mod:`kvpool.bench.cache`
(which loads torch). Each subcommand's parser imports its module and adds the module's
options the first time it parses, so ``kvpool bench store`` never pays for, or breaks
on, the cache benchmark's imports, and ``kvpool bench cache --help`` shows its options.
"""

from __future__ import annotations

import argparse
import importlib

from kvpool.config import check_at_least, check_output_path
from kvpool.errors import UserError

HELP = ("benchmarks: store (data path vs Mooncake/Redis/limits), cache (prefix cache), fuzz "
        "(hostile inputs), master (metadata at scale), chaos (failures under load), links (fetch "
        "or recompute), serve (goodput on vLLM)")

SUBCOMMANDS = {  # name -> (module with HELP / add_arguments / run, one-line help)
    "store": ("kvpool.bench.store",
              "the store's data path against Mooncake, Redis and the machine's limits"),
    "cache": ("kvpool.bench.cache", "the tiered prefix cache: hit rates and TTFT"),
    "fuzz": ("kvpool.bench.fuzz", "hostile inputs against master, node and admin HTTP (hypothesis; "
             "about 21 min at the default --inputs)"),
    "master": ("kvpool.bench.master", "the master at 1e4..1e7 objects and with 10..1,000 simulated segments"),
    "chaos": ("kvpool.bench.chaos", "kill -9 nodes, clients and the HA leader under verified load"),
    "links": ("kvpool.bench.links", "fetch a cached prefix over a shaped link, or recompute it"),
    "serve": ("kvpool.bench.serve", "goodput under SLOs: two vLLM servers behind a router, "
              "with and without kvpool"),
}


class _LazyParser(argparse.ArgumentParser):
    """A subcommand parser whose options come from ``module``, imported on first parse."""

    def __init__(self, *args, module: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._module = module

    def parse_known_args(self, args=None, namespace=None):
        if self._module:
            module, self._module = self._module, None
            self._load(module)
        if self.get_default("_bench_missing"):
            args = []  # options of a module that is not there: run() explains, once
        return super().parse_known_args(args, namespace)

    def _load(self, module: str) -> None:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            why = "it is not in this build" if exc.name == module else f"needs {exc.name!r}"
            self.set_defaults(_bench_missing=f"{module}: {why}")
            return
        self.description = getattr(mod, "HELP", self.description)
        mod.add_arguments(self)
        self.set_defaults(_bench_run=mod.run, _parser=self)


def add_arguments(parser) -> None:
    sub = parser.add_subparsers(dest="bench", metavar="BENCHMARK", parser_class=_LazyParser)
    for name, (module, help_text) in SUBCOMMANDS.items():
        sub.add_parser(name, help=help_text, description=help_text, module=module)


def run(args) -> int:
    if getattr(args, "_bench_missing", None):
        raise UserError(f"benchmark {args.bench!r} is not available ({args._bench_missing})")
    if not getattr(args, "_bench_run", None):
        raise UserError("choose a benchmark: kvpool bench " + " | ".join(SUBCOMMANDS)
                        + " (see kvpool bench --help)")
    check_arguments(args)
    return args._bench_run(args)


# counts of every benchmark that must be >= 1 when given (a zero runs nothing, or all)
_COUNTS = ("repeats", "instances", "limit", "sessions", "turns", "turn_tokens", "new_tokens",
           "page_size")


def check_arguments(args) -> None:
    """Options every benchmark shares, checked before any cell runs: counts >= 1 (0
    allowed where it means "left out"), a
    positive ``--budget``, and output files whose folder exists and is writable (else
    they fail only after the whole run). Raises: UserError naming the flag."""
    check_at_least(args, 1, *_COUNTS)
    check_at_least(args, 0, "l3_load_repeats")  # 0: left out
    budget = getattr(args, "budget", None)
    if budget is not None and not budget > 0:
        raise UserError(f"--budget must be > 0 seconds, got {budget:g}")
    check_output_path("--json", getattr(args, "json_path", None))
    check_output_path("--plot", getattr(args, "plot_path", None))
