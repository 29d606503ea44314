"""``kvpool bench cache``: trace replay through the real cache, on a trace made here."""

import json
import random

import numpy as np

from kvpool.bench.cache import QUICK
from kvpool.bench.trace_replay import NS, ChainBuilder, TraceRequest, generated_trace, load_trace
from kvpool.cache import page_chain
from kvpool.cli import main


def write_trace(path, sessions=12, turns=5, seed=0):
    """Multi-turn conversations: a shared system block, then each turn extends its
    session's prefix by 1-2 new blocks (ids unique per prefix, as in Mooncake's traces)."""
    rng = random.Random(seed)
    next_id, lines = 1, []
    history = {s: [0] for s in range(sessions)}
    for turn in range(turns):
        for s in rng.sample(range(sessions), sessions):
            for _ in range(rng.randint(1, 2)):
                history[s].append(next_id)
                next_id += 1
            ids = list(history[s])
            lines.append({"timestamp": turn * 1000, "input_length": 512 * len(ids) - rng.randint(0, 300),
                          "output_length": 10, "hash_ids": ids})
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    return lines


def max_hit_rate(lines):
    """Theoretical maximum: every full block seen before (as a prefix) is a hit."""
    seen, hits, total = set(), 0, 0
    for r in lines:
        full = r["hash_ids"][: r["input_length"] // 512]
        k = 0
        while k < len(full) and full[k] in seen:
            k += 1
        hits += 512 * k
        total += r["input_length"]
        seen.update(full)
    return hits / total


def test_replay_reports_hit_rates_and_claims(tmp_path):
    trace = tmp_path / "trace.jsonl"
    lines = write_trace(trace)
    out, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = main(["bench", "cache", "--trace", str(trace), "--capacities", "1024,4096,1e6",
               "--local-capacities", "2048,1e5", "--instances", "3", "--json", str(out),
               "--plot", str(png), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["requests"] == len(lines)
    assert abs(doc["infinite"]["hit_rate"] - max_hit_rate(lines)) < 1e-12
    rates = [r["hit_rate"] for r in doc["capacity_sweep"]]
    assert rates == sorted(rates) and rates[-1] == doc["infinite"]["hit_rate"]
    assert rates[0] < rates[-1]  # 2 blocks of LRU cannot hold the sessions
    big = doc["local_vs_global"][-1]
    assert big["global_hit_rate"] == doc["infinite"]["hit_rate"]
    assert {"claim", "measured", "holds"} <= set(doc["claims"][0])
    assert png.stat().st_size > 1000


def test_trace_blocks_get_the_same_keys_as_their_token_ids():
    req = TraceRequest(0, 3 * 512 + 7, (4, 9, 2, 11))
    tokens = np.concatenate([np.arange(512) + h * 512 for h in req.hash_ids])[:req.input_length]
    chain = ChainBuilder().chain(req)
    assert chain.keys == page_chain(NS, tokens.tolist()).keys and len(chain.keys) == 3


def test_a_bad_trace_is_a_clear_error(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10}\n')
    assert main(["bench", "cache", "--trace", str(bad), "--no-progress"]) == 2
    assert "not a trace record" in capsys.readouterr().err
    assert main(["bench", "cache", "--trace", str(tmp_path / "none.jsonl")]) == 2


def test_load_trace_limit(tmp_path):
    trace = tmp_path / "t.jsonl"
    write_trace(trace)
    assert len(load_trace(str(trace), limit=7)) == 7


def test_engine_sweep_on_a_tiny_model_reports_reuse_per_tier(tmp_path):
    out = tmp_path / "e.json"
    rc = main(["bench", "cache", "--engine", "--model", "tiny-random", "--sessions", "2",
               "--turns", "3", "--prefix-tokens", "64", "--turn-tokens", "32",
               "--new-tokens", "2", "--repeats", "1", "--json", str(out), "--plot", str(tmp_path / "e.png"),
               "--no-progress"])
    assert rc == 0
    rows = {r["name"]: r for r in json.loads(out.read_text())["configs"]}
    assert rows["no cache"]["token_hit_rate"] == 0
    roomy = rows["L1 roomy"]["token_hit_rate"]
    assert roomy > 0 and rows["L1 small"]["token_hit_rate"] < roomy
    # an L2 as large as the working set gets back what the small L1 lost
    for policy in ("write_through", "write_back"):
        row = rows[f"L1 small + L2 {policy}"]
        assert row["token_hit_rate"] == roomy and row["reused_by_tier"].get("L2", 0) > 0


def test_quick_runs_both_workloads_and_a_generated_trace(tmp_path):
    out, png = tmp_path / "q.json", tmp_path / "q.png"
    # --quick's own plan, on the tiny model and one session (kept: not their defaults)
    rc = main(["bench", "cache", "--quick", "--model", "tiny-random", "--sessions", "1",
               "--json", str(out), "--plot", str(png), "--no-progress"])
    assert rc == 0
    doc = json.loads(out.read_text())
    for workload in ("chat", "system"):
        run = doc["engine"][workload]
        assert run["workload"] == workload and run["repeats"] == QUICK["repeats"]
        assert run["requests"] == QUICK["turns"]  # one session (chat) or user per turn
        rows = {r["name"]: r for r in run["configs"]}
        assert rows["no cache"]["token_hit_rate"] == 0 < rows["L1 roomy"]["token_hit_rate"]
        assert (tmp_path / f"q_{workload}.png").stat().st_size > 1000
    lines = [{"input_length": r.input_length, "hash_ids": r.hash_ids}
             for r in generated_trace(12, 5)]
    assert doc["trace"]["requests"] == len(lines)
    assert abs(doc["trace"]["infinite"]["hit_rate"] - max_hit_rate(lines)) < 1e-12
    assert doc["trace"]["claims"] == []  # the paper's claims are about its own traces
    assert (tmp_path / "q_trace.png").stat().st_size > 1000
