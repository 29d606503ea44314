"""``kvpool bench serve``: goodput under TTFT and TPOT SLOs, two vLLM instances behind
a router, with and without kvpool, the same requests at the same arrival times.

Configurations (``--configs``):

- ``a``: vLLM with its local prefix cache only; least-loaded routing.
- ``a2``: vLLM with its bundled ``ExampleConnector`` (KV of whole prompts as files in a
  folder both instances share), the anchor vLLM itself ships; least-loaded routing.
- ``b``: vLLM with kvpool's connector, one shared store (a master, and a node per
  instance's host, each instance saving to its own first); least-loaded routing.
- ``c``: (b) with prefix-aware routing that asks the master which instance holds the
  longest prefix (:mod:`kvpool.bench.serve_router`).

(b) and (c) run on the same two servers. Each run (configuration, workload, rate) has
its own ``cache_salt``, so it starts with nothing cached anywhere: no run reuses KV
another one computed (ExampleConnector ignores the salt: its folder is emptied
before each run instead).

SLOs: unless given, SLO_TTFT_SCALE times the TTFT and SLO_TPOT_SCALE times the TPOT
of the workload's typical request (prompt length nearest the mean) run cold, alone on
an idle instance (medians of the preset's ``calibration_runs`` such runs: the
calibration, run on the first configuration's servers). Offered rates: ``--rates``
(requests/s), else ``--rate-multipliers`` times the estimated capacity of two
instances without any cache (2 / the calibration request's end-to-end time); then up
to ``--extend-rates`` more for a configuration still short of its knee
(:func:`rates_to_run`). Workloads:
:mod:`kvpool.bench.serve_workloads`; the client: :mod:`kvpool.bench.serve_client`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

from kvpool.bench.links import parse_list
from kvpool.bench.logs import RunLogs
from kvpool.bench.serve_client import run_load, summarize
from kvpool.bench.serve_fleet import BLOCK_SIZE, HASH_ALGO, Fleet, counter_delta, vllm_python
from kvpool.bench.serve_router import Router
from kvpool.bench.serve_workloads import (WORKLOADS, Workload, chat_workload,
                                          conversation_sample, system_workload, trace_workload)
from kvpool.errors import UserError

HELP = ("goodput under TTFT/TPOT SLOs: two vLLM servers behind a router, local prefix "
        "cache vs ExampleConnector vs kvpool vs kvpool + prefix-aware routing")
CONFIGS = {"a": ("plain", "least_loaded", "vLLM local prefix cache"),
           "a2": ("example", "least_loaded", "vLLM + ExampleConnector (local disk)"),
           "b": ("kvpool", "least_loaded", "vLLM + kvpool, shared store"),
           "c": ("kvpool", "prefix", "(b) + prefix-aware routing (master lookup)")}
INSTANCES = 2
# A configuration whose goodput at its highest rate beats its best below by RISE has not
# reached its knee: it runs again at EXTEND_STEP times that rate (up to --extend-rates
# times). The planned rates are placed from the cold capacity estimate, which a cache
# raises: in a chat run (3 rates, 1.5-4.5x the estimate), (a) peaked at the lowest rate
# while (b) and (c) still rose at the highest.
RISE, EXTEND_STEP = 1.1, 1.5
# Default SLOs as multiples of the calibration's TTFT and TPOT. The calibration request
# decodes alone; under load each step also carries other requests' decodes and prefill
# chunks, which on a CPU stretch it: at 2x TPOT (108 ms) the loaded ITL p50 of every
# configuration (70-120 ms) sat at the SLO, and goodput measured that noise, not the
# cache. At 3x a request still misses when a whole cold prefill stalls its decode.
SLO_TTFT_SCALE, SLO_TPOT_SCALE = 2.0, 3.0
MAX_MODEL_LEN = 4096  # tokens of vLLM's context, unless an instance's KV cache holds fewer
TRACE_WINDOW = 5000  # trace requests read, to sample whole conversations from
# Each instance's own KV cache is limited to ``kv_blocks`` blocks of BLOCK_SIZE tokens, as
# a GPU's HBM limits it, while the store's segments hold several times more. Full: 96
# blocks (3,040 tokens) hold about a third of the chat documents, so (a) misses them
# at every rate; at 160 blocks (5,120) (a) kept 45-75% hits when few sessions overlapped,
# and goodput followed how its router happened to place sessions (b/a 0.84-2.22x over
# six runs). --quick: the two workloads and two rates (near and past the knee) that
# fit in about five minutes here; its documents nearly fit one instance. Calibration:
# the median of 3 cold runs (one run's TPOT varied 54-97 ms between benchmark runs
# here), 1 in --quick (3 took it to 5 min 28 s).
QUICK = {"sessions": 6, "turns": 2, "docs": 4, "doc_tokens": 512, "requests": 12,
         "max_tokens": 12, "trace_limit": 10, "trace_block": 32, "multipliers": "1.5,3",
         "workloads": "chat,system", "kv_blocks": 64, "extend": 0,
         "calibration_runs": 1}
FULL = {"sessions": 12, "turns": 3, "docs": 8, "doc_tokens": 1024, "requests": 24,
        "max_tokens": 16, "trace_limit": 12, "trace_block": 32,
        "multipliers": "1.5,3", "workloads": ",".join(WORKLOADS), "kv_blocks": 96,
        "extend": 1, "calibration_runs": 3}


def add_arguments(p) -> None:
    p.add_argument("--quick", action="store_true",
                   help="short prompts, few requests, 2 workloads, 2 rates (see QUICK in the module)")
    p.add_argument("--configs", default="a,a2,b,c", help="configurations (default a,a2,b,c)")
    p.add_argument("--workloads", default=None,
                   help=f"workloads (default {FULL['workloads']}; --quick {QUICK['workloads']})")
    p.add_argument("--trace", default=None,
                   help="Mooncake trace for the trace workload (default $KVPOOL_TRACE, else "
                   "shared/traces beside the repository, else a generated one)")
    p.add_argument("--rates", default=None, help="offered rates in requests/s")
    p.add_argument("--rate-multipliers", default=None,
                   help="rates as multiples of the cold capacity estimate (default "
                   f"{FULL['multipliers']}; --quick {QUICK['multipliers']})")
    p.add_argument("--extend-rates", type=int, default=None,
                   help=f"more rates, each {EXTEND_STEP}x the last, for a configuration whose goodput "
                   f"still rises at its highest (default {FULL['extend']}; --quick {QUICK['extend']})")
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help=f"TTFT SLO in ms (default: {SLO_TTFT_SCALE:g}x the calibration's cold TTFT)")
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help=f"TPOT (mean ITL) SLO in ms (default: {SLO_TPOT_SCALE:g}x the calibration's cold TPOT)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help=f"vLLM context (default {MAX_MODEL_LEN}, or what --kv-blocks holds if less)")
    p.add_argument("--kv-blocks", type=int, default=None,
                   help="KV cache blocks of 32 tokens each vLLM instance holds itself (default "
                   f"{FULL['kv_blocks']}; --quick {QUICK['kv_blocks']}; 0: all that "
                   "VLLM_CPU_KVCACHE_SPACE=1 GiB holds)")
    p.add_argument("--segment-size", default="512MiB",
                   help="each kvpool node's segment (512MiB)")
    p.add_argument("--vllm-python", default=None,
                   help="vLLM's interpreter (default $KVPOOL_VLLM_PYTHON, else .venv-vllm)")
    p.add_argument("--log-dir", default=None,
                   help="keep the servers' logs here (default: a temporary folder, kept only when the run fails)")
    p.add_argument("--seed", type=int, default=0, help="arrival-time seed (0)")
    p.add_argument("--json", dest="json_path", default="bench_serve.json",
                   help="JSON output (default bench_serve.json)")
    p.add_argument("--plot", dest="plot_path", default="bench_serve.png",
                   help="PNG output (default bench_serve.png; '' for none)")


def _names(text: str, known, what: str) -> list[str]:
    names = [x.strip() for x in text.split(",") if x.strip()]
    bad = [x for x in names if x not in known]
    if bad or not names:
        raise UserError(f"{what} must be among {', '.join(known)}, got {text!r}")
    return names


def build_workloads(names: list[str], size: dict, model: str, trace_path: str | None,
                    max_model_len: int) -> list[Workload]:
    """The chosen workloads at ``size`` (QUICK or FULL), tokenized for ``model``."""
    from transformers import AutoTokenizer

    from kvpool.bench.trace_replay import default_trace, generated_trace, load_trace

    tok = AutoTokenizer.from_pretrained(model)
    out = []
    for name in names:
        if name == "chat":
            out.append(chat_workload(tok, size["sessions"], size["turns"], size["docs"],
                                     size["doc_tokens"], size["max_tokens"]))
        elif name == "system":
            out.append(system_workload(tok, size["requests"], size["doc_tokens"],
                                       size["max_tokens"]))
        else:
            path = trace_path or default_trace()
            trace = (load_trace(path, TRACE_WINDOW) if trace_path or os.path.isfile(path)
                     else generated_trace(4, 3))
            trace = conversation_sample(trace, size["trace_limit"])
            out.append(trace_workload(trace, len(tok), size["trace_block"],
                                      max_model_len - size["max_tokens"] - 1, size["max_tokens"]))
    for w in out:
        longest = max(len(r.prompt) for r in w.requests)
        if longest + size["max_tokens"] > max_model_len:
            raise UserError(f"workload {w.name}: a prompt of {longest} tokens does not fit "
                            f"--max-model-len {max_model_len}")
    return out


def run(args) -> int:
    from kvpool.config import parse_size
    from kvpool.engine.model_cli import model_folder

    size = QUICK if args.quick else FULL
    configs = _names(args.configs, CONFIGS, "--configs")
    names = _names(args.workloads or size["workloads"], WORKLOADS, "--workloads")
    rates = parse_list(args.rates, "--rates") if args.rates else None
    multipliers = parse_list(args.rate_multipliers or size["multipliers"], "--rate-multipliers")
    kv_blocks, max_model_len = kv_capacity(size["kv_blocks"] if args.kv_blocks is None else args.kv_blocks,
                                           args.max_model_len)
    python = vllm_python(args.vllm_python)
    model = str(model_folder("smollm2"))
    workloads = build_workloads(names, size, model, args.trace, max_model_len)
    with RunLogs(args.log_dir, "kvpool-bench-serve-") as logs:  # kept with partial.json when a run fails
        bench = ServeBench(model, workloads, configs, python, Path(logs.path), max_model_len,
                           parse_size(args.segment_size), args.seed, kv_blocks=kv_blocks or None,
                           extend=size["extend"] if args.extend_rates is None else args.extend_rates,
                           calibration_runs=size["calibration_runs"])
        doc = bench.run(rates, multipliers, args.slo_ttft_ms, args.slo_tpot_ms)
    doc["command"] = "kvpool bench serve" + (" --quick" if args.quick else "")
    doc["size"] = size
    print(format_tables(doc))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json_path}")
    if args.plot_path:
        plot_goodput(doc, args.plot_path)
        print(f"wrote {args.plot_path}")
    return 0


def kv_capacity(kv_blocks: int, max_model_len: int | None) -> tuple[int, int]:
    """(blocks each instance holds, vLLM's context in tokens): ``max_model_len`` given,
    else MAX_MODEL_LEN or what ``kv_blocks`` holds if fewer (0 blocks: vLLM's own
    capacity). vLLM keeps one block back (its null block), so ``kv_blocks`` hold
    ``(kv_blocks - 1) * BLOCK_SIZE`` tokens of one request. Raises UserError when that
    is less than the context."""
    usable = max(kv_blocks - 1, 0) * BLOCK_SIZE
    if max_model_len is None:
        max_model_len = min(MAX_MODEL_LEN, usable) if kv_blocks else MAX_MODEL_LEN
    if kv_blocks < 0 or (kv_blocks and usable < max_model_len):
        raise UserError(f"--kv-blocks {kv_blocks} hold {usable} tokens of a request, fewer than "
                        f"--max-model-len {max_model_len}")
    return kv_blocks, max_model_len


class ServeBench:
    """One benchmark run over configurations, workloads and rates (module docstring)."""

    def __init__(self, model: str, workloads: list[Workload], configs: list[str],
                 python: Path, log_dir: Path, max_model_len: int, segment_size: int,
                 seed: int = 0, progress=print, kv_blocks: int | None = None, extend: int = 0,
                 calibration_runs: int = 1):
        self.model, self.workloads, self.configs = model, workloads, configs
        self.python, self.log_dir, self.max_model_len = python, log_dir, max_model_len
        self.segment_size, self.seed, self.progress = segment_size, seed, progress
        self.kv_blocks, self.extend = kv_blocks, extend
        self.calibration_runs = calibration_runs
        self.nonce = f"{int(time.time())}-{os.getpid()}"
        self.example_dir = log_dir / "example-connector"

    def run(self, rates, multipliers, slo_ttft_ms, slo_tpot_ms) -> dict:
        from kvpool.launch import Cluster

        kinds = list(dict.fromkeys(CONFIGS[c][0] for c in self.configs))
        results: dict = {w.name: {c: [] for c in self.configs} for w in self.workloads}
        plan: dict = {}
        failed: dict[str, str] = {}  # config -> why its runs stopped
        cluster = None
        try:
            for kind in kinds:
                if kind == "kvpool":  # only now: its segments take memory
                    cluster = Cluster(segment_size=self.segment_size, num_nodes=INSTANCES).start()
                fleet = Fleet(kind, self.model, self.log_dir, INSTANCES,
                              master=cluster.master_addr if cluster else "",
                              segments=[n["segment"] for n in cluster.nodes] if cluster else [],
                              example_dir=self.example_dir, max_model_len=self.max_model_len,
                              python=self.python, kv_blocks=self.kv_blocks)
                self.progress(f"starting {INSTANCES} vLLM servers ({kind}) ...")
                with fleet:
                    self.progress(f"  healthy after {fleet.startup_s:.0f} s")
                    if not plan:
                        plan = self.calibrate(fleet, rates, multipliers, slo_ttft_ms, slo_tpot_ms)
                    self._runs(fleet, cluster, kind, plan, results, failed)
        finally:
            if cluster is not None:
                cluster.stop()
        return {"conditions": self.conditions(), "plan": plan, "results": results,
                "failed": failed, "knee": knee(results, self.configs)}

    def _runs(self, fleet: Fleet, cluster, kind: str, plan: dict, results: dict,
              failed: dict) -> None:
        """Every run of the configurations served by ``fleet``: the planned rates, then
        up to ``extend`` more (each EXTEND_STEP times the last) while the configuration's
        goodput still rises at its highest rate, so each one's knee is reached
        (:func:`rates_to_run`). A server that dies ends them: the configuration's
        remaining runs are recorded in ``failed`` with the server's last error, and the
        next kind of servers starts."""
        for config in (c for c in self.configs if CONFIGS[c][0] == kind):
            for w in self.workloads:
                rows, planned = results[w.name][config], plan[w.name]["rates"]
                for k, rate in enumerate(rates_to_run(planned, rows, self.extend)):
                    try:
                        row = self.one_run(fleet, cluster, config, w, k, rate, plan[w.name])
                    except OSError:  # URLError too: a server that stopped answering
                        dead = fleet.dead(wait_s=60.0)
                        if not dead:
                            raise
                        failed[config] = f"from {w.name} at {rate} req/s: " + "; ".join(dead)
                        self.progress(f"  {config}: a server died, its other runs are skipped "
                                      f"({failed[config]})")
                        return
                    row["extended"] = k >= len(planned)
                    rows.append(row)
                    self.checkpoint({"plan": plan, "results": results, "failed": failed})

    def checkpoint(self, partial: dict) -> None:
        """The figures so far, in ``partial.json`` of the log folder (a run that dies
        half way, a server killed for memory, keeps what it measured)."""
        (self.log_dir / "partial.json").write_text(json.dumps(partial, indent=1))

    def conditions(self) -> dict:
        return {"model": Path(self.model).name, "instances": INSTANCES,
                "engine": "vllm serve (vllm-cpu), fp32, block 32, one core per instance",
                "configs": {c: CONFIGS[c][2] for c in self.configs},
                "kv_blocks_per_instance": self.kv_blocks, "max_model_len": self.max_model_len,
                "cpus": os.cpu_count(), "load_average_end": os.getloadavg()}

    def _salt(self, *parts) -> str:
        return "-".join(str(p) for p in (*parts, self.nonce))

    def calibrate(self, fleet: Fleet, rates, multipliers, slo_ttft_ms, slo_tpot_ms) -> dict:
        """Per workload: the typical prompt run cold, alone, ``calibration_runs`` times
        (after one warm-up request); the SLOs and rates that follow from the medians
        (module docstring)."""
        plan = {}
        for k, w in enumerate(self.workloads):
            req = dataclasses.replace(w.typical_request(), after=None)  # alone
            if k == 0:  # the servers' first request pays their warm-up
                self._alone(fleet, req, w.name, "warmup")
            runs = [self._alone(fleet, req, w.name, f"cold{i}")
                    for i in range(self.calibration_runs)]
            ttft, tpot, e2e = (statistics.median(v) for v in zip(*runs))
            capacity = INSTANCES / e2e
            plan[w.name] = {
                "cold_ttft_ms": ttft * 1e3, "cold_tpot_ms": tpot * 1e3,
                "cold_e2e_ms": e2e * 1e3, "cold_prompt_tokens": len(req.prompt),
                "capacity_estimate_rps": capacity,
                "slo_ttft_ms": slo_ttft_ms or SLO_TTFT_SCALE * ttft * 1e3,
                "slo_tpot_ms": slo_tpot_ms or SLO_TPOT_SCALE * (tpot or ttft) * 1e3,
                "rates": rates or [round(m * capacity, 3) for m in multipliers],
                "requests": len(w.requests),
                "mean_prompt_tokens": sum(len(r.prompt) for r in w.requests) / len(w.requests)}
            self.progress(f"  {w.name}: cold TTFT {ttft * 1e3:.0f} ms, TPOT "
                          f"{tpot * 1e3:.0f} ms ({_runs_text(self.calibration_runs)}) -> SLO TTFT "
                          f"{plan[w.name]['slo_ttft_ms']:.0f} ms, TPOT "
                          f"{plan[w.name]['slo_tpot_ms']:.0f} ms; rates {plan[w.name]['rates']}")
        return plan

    def _alone(self, fleet: Fleet, req, workload: str, tag: str) -> tuple[float, float, float]:
        """``req`` alone on the first instance, with a salt of its own (cold): its TTFT,
        TPOT (0 with fewer than 2 tokens) and end-to-end time, seconds."""
        (out,), _ = asyncio.run(run_load(fleet.urls[:1], self.model, [req], [0.0], Router(1),
                                         self._salt("calibrate", workload, tag)))
        if out.error:
            raise UserError(f"calibration request failed: {out.error}")
        return out.ttft_s, out.tpot_s or 0.0, out.chunk_s[-1]

    def _router(self, config: str, fleet: Fleet, client) -> Router:
        policy = CONFIGS[config][1]
        if policy != "prefix":
            return Router(INSTANCES)
        from kvpool.integrations.vllm.keys import KeySpace

        keys = KeySpace(self.model, "float32", BLOCK_SIZE, "cpu", hash_algo=HASH_ALGO)
        return Router(INSTANCES, "prefix", fleet.segments, client, keys,
                      os.environ.get("PYTHONHASHSEED", "vllm-none-hash"))

    def one_run(self, fleet: Fleet, cluster, config: str, w: Workload, k: int, rate: float,
                plan: dict) -> dict:
        from kvpool.client import Client

        if fleet.kind == "example":
            shutil.rmtree(self.example_dir, ignore_errors=True)
        self.example_dir.mkdir(parents=True, exist_ok=True)
        client = Client(cluster.master_addr) if CONFIGS[config][1] == "prefix" else None
        try:
            router = self._router(config, fleet, client)
            before = fleet.counters()
            outcomes, duration = asyncio.run(run_load(
                fleet.urls, self.model, w.requests, w.arrivals(rate, self.seed), router,
                self._salt(config, w.name, k)))
            after = fleet.counters()
        finally:
            if client is not None:
                client.close()
        row = {"rate_rps": rate, **summarize(outcomes, duration, plan["slo_ttft_ms"] / 1e3,
                                             plan["slo_tpot_ms"] / 1e3),
               "counters": counter_delta(before, after), "routing": router.decisions,
               "bytes_moved": _bytes_moved(fleet, counter_delta(before, after), self.example_dir)}
        self.progress(f"  {config:2s} {w.name:6s} {rate:6.3f} req/s: goodput "
                      f"{row['goodput_rps']:.3f} req/s, TTFT p50 "
                      f"{_ms(row['ttft_ms']['p50'])}, hit rate {row['hit_rate']:.0%}")
        return row


def _bytes_moved(fleet: Fleet, counters: dict, example_dir: Path) -> int:
    """KV bytes through the connector in a run: kvpool's loaded + saved, or the size
    of ExampleConnector's files (written once, read back on a hit)."""
    if fleet.kind == "kvpool":
        return int(counters.get("kvpool_vllm_bytes_loaded_total", 0)
                   + counters.get("kvpool_vllm_bytes_saved_total", 0))
    if fleet.kind == "example":
        return sum(f.stat().st_size for f in example_dir.rglob("*") if f.is_file())
    return 0


def _runs_text(n: int) -> str:
    return "1 run" if n == 1 else f"median of {n} runs"


def _ms(v) -> str:
    return "-" if v is None else f"{v:.0f} ms"


def rates_to_run(planned: list[float], rows: list[dict], extend: int) -> Iterator[float]:
    """The offered rates of one configuration and workload: ``planned``, then up to
    ``extend`` more, each EXTEND_STEP times the last, while :func:`still_rising` holds
    for ``rows`` (the runs so far, which the caller appends to between rates)."""
    rate = 0.0
    for rate in planned:
        yield rate
    for _ in range(extend):
        if not still_rising(rows):
            return
        rate = round(rate * EXTEND_STEP, 3)
        yield rate


def still_rising(rows: list[dict]) -> bool:
    """Whether the goodput at the highest rate run so far (the last row) beats the best
    at the rates below it by RISE: the knee is not reached yet."""
    if not rows:
        return False
    below = max((r["goodput_rps"] for r in rows[:-1]), default=0.0)
    return rows[-1]["goodput_rps"] > RISE * below


def knee(results: dict, configs: list[str]) -> dict:
    """Per workload: each configuration's peak goodput over the offered rates (the
    knee: where goodput stops rising), and its ratio to (a) and (a2)."""
    out = {}
    for w, by_config in results.items():
        peak = {c: max((r["goodput_rps"] for r in rows), default=0.0)
                for c, rows in by_config.items()}
        ratios = {}
        for c in configs:
            for base in ("a", "a2"):
                if base in peak and c != base and peak[base] > 0:
                    ratios[f"{c}/{base}"] = peak[c] / peak[base]
        out[w] = {"peak_goodput_rps": peak, "ratios": ratios}
    return out


def format_tables(doc: dict) -> str:
    """A Markdown table per workload, then the knee ratios."""
    lines = []
    for w, by_config in doc["results"].items():
        p = doc["plan"][w]
        lines += [f"### {w}: {p['requests']} requests, mean prompt "
                  f"{p['mean_prompt_tokens']:.0f} tokens; SLO TTFT {p['slo_ttft_ms']:.0f} ms, "
                  f"TPOT {p['slo_tpot_ms']:.0f} ms", "",
                  "| config | offered req/s | throughput | goodput | missed TTFT / TPOT SLO "
                  "| TTFT p50/p90/p99 ms | ITL p50/p90/p99 ms | hit rate (local / connector) "
                  "| MB moved |",
                  "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for c, rows in by_config.items():
            for r in rows:
                cnt = r["counters"]
                q = cnt.get("vllm:prefix_cache_queries_total", 0) or 1
                local = cnt.get("vllm:prefix_cache_hits_total", 0) / q
                ext = cnt.get("vllm:external_prefix_cache_hits_total", 0) / q
                t, i = r["ttft_ms"], r["itl_ms"]
                lines.append(
                    f"| {c} | {r['rate_rps']:.3f}{'+' if r.get('extended') else ''} | "
                    f"{r['throughput_rps']:.3f} | "
                    f"{r['goodput_rps']:.3f} | {r.get('missed_ttft', '–')} / "
                    f"{r.get('missed_tpot', '–')} of {r['requests']} | {_triple(t)} | {_triple(i)} | "
                    f"{r['hit_rate']:.0%} ({local:.0%} / {ext:.0%}) | "
                    f"{r['bytes_moved'] / 1e6:.0f} |")
        ratios = doc["knee"][w]["ratios"]
        if any(r.get("extended") for rows in by_config.values() for r in rows):
            lines += ["", "+: a rate added because that configuration's goodput still rose"]
        lines += ["", "knee (peak goodput): " + ", ".join(
            f"{c} {v:.3f} req/s" for c, v in doc["knee"][w]["peak_goodput_rps"].items())
            + ("; " + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()) if ratios else ""),
            ""]
    lines += [f"{c}: not measured further, a server died {why}" for c, why in doc.get("failed", {}).items()]
    return "\n".join(lines)


def _triple(d: dict) -> str:
    return "/".join("-" if d[k] is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))


def plot_goodput(doc: dict, path: str) -> None:
    """Goodput vs offered rate, one panel per workload, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(doc["results"])
    fig, axes = plt.subplots(1, len(workloads), figsize=(5 * len(workloads), 4), squeeze=False)
    for ax, w in zip(axes[0], workloads):
        for c, rows in doc["results"][w].items():
            ax.plot([r["rate_rps"] for r in rows], [r["goodput_rps"] for r in rows], "o-",
                    label=f"({c}) {doc['conditions']['configs'][c]}")
        ax.set_title(f"{w} (SLO TTFT {doc['plan'][w]['slo_ttft_ms']:.0f} ms, "
                     f"TPOT {doc['plan'][w]['slo_tpot_ms']:.0f} ms)", fontsize=9)
        ax.set_xlabel("offered rate (requests/s)")
        ax.set_ylabel("goodput (requests/s meeting both SLOs)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


