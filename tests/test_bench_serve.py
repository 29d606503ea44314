"""`kvpool bench serve` parts: the prefix-aware router's master lookup (real cluster, two
nodes), the workloads' prefix structure and arrival times, goodput accounting."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvpool.bench.serve import knee, rates_to_run
from kvpool.bench.serve_client import Outcome, summarize
from kvpool.bench.serve_router import Router
from kvpool.bench.serve_workloads import chat_workload, system_workload, trace_workload
from kvpool.bench.trace_replay import TraceRequest
from kvpool.cache.compat import vllm_block_hashes
from kvpool.client import Client
from kvpool.engine.models import load_model
from kvpool.integrations.vllm.keys import KeySpace

BLOCK = 32
SEED = "vllm-none-hash"


@pytest.fixture(scope="module")
def tokenizer():
    return load_model("tiny-random").tokenizer


def _keys() -> KeySpace:
    return KeySpace("SmolLM2-test", "float32", BLOCK, "cpu", hash_algo="sha256_cbor")


def _store(client: Client, keys: KeySpace, prompt: list[int], salt: str, blocks: int,
           segment: str) -> None:
    """Put the first ``blocks`` blocks of ``prompt`` (their vLLM keys) on ``segment``."""
    hashes = vllm_block_hashes(prompt, BLOCK, SEED, [(("cache_salt", salt),)] + [None] * 99)
    for key in keys.store_keys(hashes[:blocks], 0, 0, salt, ""):
        assert client.put(key, b"x" * 256, preferred_segment=segment) == 1


@pytest.mark.cluster(num_nodes=2, segment_size="16MiB")
def test_prefix_router_picks_the_instance_holding_the_longest_prefix(cluster):
    segments = [n["segment"] for n in cluster.nodes]
    keys = _keys()
    rng = np.random.default_rng(0)
    a, b, other = (rng.integers(0, 5000, 10 * BLOCK + 5).tolist() for _ in range(3))
    with Client(cluster.master_addr) as c:
        _store(c, keys, a, "s", 6, segments[1])  # instance 1 computed 6 blocks of a
        _store(c, keys, b, "s", 8, segments[0])  # instance 0: 8 blocks of b
        router = Router(2, "prefix", segments, c, keys, SEED)
        assert router.prefix_blocks(a, "s") == [0, 6]
        assert router.prefix_blocks(b, "s") == [8, 0]
        assert router.prefix_blocks(a[:3 * BLOCK] + other, "s") == [0, 3]  # leading run
        assert router.pick(a, "s") == 1
        assert router.pick(b, "s") == 0
        assert router.prefix_blocks(a, "other-salt") == [0, 0]  # another tenant's keys
        # nothing stored: the least loaded instance
        router.started(0)
        assert router.pick(other, "s") == 1
        # the holder has one more in flight: the other loads the prefix instead of
        # queueing behind it (balance 0: the prefix only breaks ties)
        assert router.pick(b, "s") == 1
        for _ in range(4):
            router.started(1)
        assert router.pick(a, "s") == 0  # the holder is busier still: load wins
        assert router.decisions == {"prefix": 2, "load": 3}


def test_chat_turns_extend_their_previous_turn(tokenizer):
    w = chat_workload(tokenizer, sessions=3, turns=3, docs=2, doc_tokens=120, max_tokens=4)
    assert len(w.requests) == 9
    for r in w.requests:
        if r.after is None:
            continue
        prev = w.requests[r.after]
        assert len(r.prompt) > len(prev.prompt)
        assert r.prompt[:len(prev.prompt) - 2] == prev.prompt[:len(prev.prompt) - 2]
    firsts = [r for r in w.requests if r.after is None]
    assert len(firsts) == 3
    # sessions 0 and 2 share document 0; session 1 has another one
    common = lambda x, y: next(i for i, (p, q) in enumerate(zip(x.prompt, y.prompt)) if p != q)
    assert common(firsts[0], firsts[2]) > common(firsts[0], firsts[1]) + 50


def test_system_workload_shares_one_long_prefix(tokenizer):
    w = system_workload(tokenizer, requests=4, doc_tokens=100, max_tokens=4)
    p = [r.prompt for r in w.requests]
    same = next(i for i, (x, y) in enumerate(zip(p[0], p[1])) if x != y)
    assert same > 100 and len(set(p)) == 4


def test_trace_keeps_prefix_structure_and_arrival_shape():
    trace = [TraceRequest(0, 1500, (1, 2, 3)), TraceRequest(500, 1100, (1, 2, 9)),
             TraceRequest(3000, 600, (7, 8))]
    w = trace_workload(trace, vocab=1000, block_tokens=32, max_prompt=4000, max_tokens=4)
    r0, r1, r2 = (r.prompt for r in w.requests)
    assert len(r0) == round(1500 * 32 / 512) and len(r2) == round(600 * 32 / 512)
    assert r0[:64] == r1[:64] and r0[64:69] != r1[64:69] and r0[:32] != r2[:32]
    at = w.arrivals(rate=2.0)
    assert at[0] == 0 and at[-1] == pytest.approx(2 / 2.0)  # mean rate 2 req/s
    assert at[1] / at[2] == pytest.approx(500 / 3000)       # the trace's shape kept


def test_poisson_arrivals_are_the_same_for_every_configuration(tokenizer):
    w = system_workload(tokenizer, requests=50, doc_tokens=20, max_tokens=2)
    assert w.arrivals(3.0, seed=1) == w.arrivals(3.0, seed=1)
    gaps = np.diff(w.arrivals(3.0, seed=1))
    assert 0.2 < gaps.mean() < 0.5 and w.arrivals(3.0, seed=2) != w.arrivals(3.0, seed=1)


def test_goodput_counts_requests_meeting_both_slos():
    def o(i, ttft, step, n=5, error=None):
        return Outcome(i, i % 2, 0.0, ttft, [ttft + k * step for k in range(n)], n, 100, 50, error)

    outs = [o(0, 0.1, 0.01), o(1, 0.5, 0.01), o(2, 0.1, 0.2), o(3, 0.1, 0.01, error="HTTP 500")]
    s = summarize(outs, duration_s=2.0, slo_ttft_s=0.2, slo_tpot_s=0.05)
    assert (s["completed"], s["good"]) == (3, 1)
    assert (s["missed_ttft"], s["missed_tpot"]) == (1, 1)
    assert s["goodput_rps"] == 0.5 and s["throughput_rps"] == 1.5
    assert s["hit_rate"] == 0.5 and s["per_instance"] == [2, 2]
    results = {"chat": {"a": [{"goodput_rps": 1.0}, {"goodput_rps": 0.5}],
                        "c": [{"goodput_rps": 1.6}, {"goodput_rps": 2.0}]}}
    assert knee(results, ["a", "c"])["chat"]["ratios"] == {"c/a": 2.0}


def test_a_configuration_still_rising_at_its_highest_rate_gets_another_rate():
    """Past the planned rates, one more (1.5x) while goodput still rose by > 10%; none
    for a configuration that peaked below its highest rate, nor beyond ``extend``."""
    def ran(goodputs, extend):
        rows, rates = [], []
        for rate in rates_to_run([1.0, 2.0], rows, extend):
            rates.append(rate)
            rows.append({"goodput_rps": goodputs[len(rows)]})
        return rates

    assert ran([0.5, 0.9, 1.2, 1.5], extend=2) == [1.0, 2.0, 3.0, 4.5]
    assert ran([0.5, 0.9, 0.95], extend=2) == [1.0, 2.0, 3.0]  # 0.95 < 1.1 x 0.9
    assert ran([0.5, 0.4], extend=2) == [1.0, 2.0]  # peaked at the first rate
    assert ran([0.5, 0.9, 1.2], extend=0) == [1.0, 2.0]


@pytest.mark.slow
def test_bench_serve_end_to_end_on_two_vllm_servers(tmp_path, capsys):
    """(b) and (c) on one pair of real `vllm serve` instances, one rate, the shared
    system prompt: every request completes, kvpool moves KV, (c) routes by prefix."""
    import json

    from kvpool.cli import main
    from vllm_harness import VLLM_PYTHON, require_vllm

    require_vllm()
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--quick", "--configs", "b,c", "--workloads", "system",
                 "--rates", "1", "--vllm-python", str(VLLM_PYTHON), "--log-dir",
                 str(tmp_path / "logs"), "--json", str(out),
                 "--plot", str(tmp_path / "serve.png")]) == 0
    doc = json.loads(out.read_text())
    b, c = doc["results"]["system"]["b"][0], doc["results"]["system"]["c"][0]
    for row in (b, c):
        assert row["completed"] == row["requests"] == 12 and not row["errors"]
        assert row["counters"]["kvpool_vllm_bytes_saved_total"] > 0
        assert row["hit_rate"] > 0.3  # the shared system prompt is found again
    assert c["routing"]["prefix"] >= 3 and b["routing"]["prefix"] == 0
    assert (tmp_path / "serve.png").stat().st_size > 0
    assert "knee (peak goodput)" in capsys.readouterr().out


def test_conversation_sample_keeps_whole_multi_turn_conversations():
    from kvpool.bench.serve_workloads import conversation_sample

    t = [TraceRequest(0, 600, (0, 1, 2)), TraceRequest(0, 600, (0, 5)),
         TraceRequest(10, 900, (0, 1, 2, 3)), TraceRequest(20, 600, (0, 7, 8)),
         TraceRequest(30, 700, (0, 7, 9)), TraceRequest(40, 800, (0, 1, 2, 3, 4))]
    assert conversation_sample(t, 5) == [t[0], t[2], t[3], t[4], t[5]]
    assert conversation_sample(t, 2) == [t[3], t[4]]  # the 3-turn one does not fit


def test_a_dead_server_is_named_with_its_last_error(tmp_path):
    import subprocess
    import sys

    from kvpool.bench.serve_fleet import Fleet

    fleet = Fleet("example", "model", tmp_path, instances=2, python=Path(sys.executable))
    script = "import sys; print('INFO fine'); print(\"RuntimeError: Worker failed with error 'No such file'\"); sys.exit(3)"
    for i, code in enumerate(("import time; time.sleep(60)", script)):
        with open(fleet.log_path(i), "w") as log:
            fleet.procs.append(subprocess.Popen([sys.executable, "-c", code], stdout=log,
                                                start_new_session=True))
    try:
        assert fleet.dead(wait_s=30) == ["example 1 exited with 3: RuntimeError: Worker failed with error 'No such file'"]
    finally:
        fleet.stop()
    assert fleet.procs == []


def test_kv_blocks_bound_the_context_and_reach_vllm(tmp_path):
    """An instance's KV cache (--kv-blocks) sets vLLM's default context and goes to
    `vllm serve` as --num-gpu-blocks-override; too few blocks for the context is a
    clear error, before any server starts."""
    import sys

    from kvpool.bench.serve import kv_capacity
    from kvpool.bench.serve_fleet import Fleet
    from kvpool.errors import UserError

    assert kv_capacity(64, None) == (64, 2016)  # 63 blocks of 32 tokens: vLLM keeps one back
    assert kv_capacity(160, None) == (160, 4096)  # more than the default context
    assert kv_capacity(0, None) == (0, 4096)  # vLLM's own capacity
    with pytest.raises(UserError, match="hold 288 tokens of a request, fewer than --max-model-len 4096"):
        kv_capacity(10, 4096)
    fleet = Fleet("plain", "model", tmp_path, instances=1, python=Path(sys.executable),
                  max_model_len=2016, kv_blocks=64)
    fleet.ports = [8000]
    cmd = fleet.command(0)
    assert cmd[cmd.index("--num-gpu-blocks-override") + 1] == "64"
    assert cmd[cmd.index("--max-model-len") + 1] == "2016"
    own = Fleet("plain", "model", tmp_path, instances=1, python=Path(sys.executable))
    own.ports = [8000]
    assert "--num-gpu-blocks-override" not in own.command(0)  # vLLM's own capacity
