"""One vLLM instance as a measured process: the harness of kvpool's vLLM tests and bench.

``python -m kvpool.bench.vllm run JOB.json OUT.json`` starts ``vllm.LLM`` (engine in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the connector's counters are readable
here) with the job's KV connector, runs its prompts one after another and writes, per
prompt, the greedy output token ids, vLLM's ``num_cached_tokens``, the TTFT (engine
timestamps: first token minus queued) and the wall time of the whole request, then the
connector's counters after the engine has shut down (its saves are done then), and the
``vllm:kvpool_*`` counters vLLM's Prometheus logger kept from the connector's stats.

JOB: {"model": folder, "connector": null | kv_transfer_config dict,
      "prompts": [{"question": str (about the shipped document) | "text": str (a short chat),
                   "max_tokens": int, "cache_salt": str | null}],
      "vllm": {extra vllm.LLM keyword arguments}}
``python -m kvpool.bench.vllm compare [OUT.json]`` prints the figures of docs/bench.md
(:func:`compare`). Needs vLLM (``scripts/setup-vllm.sh``); imported only in :func:`run_job`.
"""

from __future__ import annotations

import json
import os
import sys
import time

from kvpool.engine.workload import chat_prompt_ids, first_user_message, load_workload

LLM_DEFAULTS = {"dtype": "float32", "block_size": 32, "enforce_eager": True,
                "max_model_len": 4096, "gpu_memory_utilization": 0.5, "seed": 0,
                "disable_log_stats": False}


def prompt_messages(question: str) -> list[dict]:
    """The demo's chat: system message, then the shipped document and ``question``."""
    workload = load_workload()
    return [{"role": "system", "content": workload["system"]},
            {"role": "user", "content": first_user_message(workload, question)}]


def run_job(job: dict) -> dict:
    """Run one instance (see module docstring); returns {"startup_s", "prompts", "metrics",
    "vllm_metrics"}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import prometheus_client
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kwargs = {**LLM_DEFAULTS, **job.get("vllm", {})}
    if job.get("connector"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["connector"])
    started = time.monotonic()
    llm = LLM(model=job["model"], **kwargs)
    startup_s = time.monotonic() - started
    tokenizer = llm.get_tokenizer()
    results = []
    for p in job["prompts"]:
        messages = ([{"role": "user", "content": p["text"]}] if "text" in p
                    else prompt_messages(p["question"]))
        ids = chat_prompt_ids(tokenizer, messages)
        prompt = TokensPrompt(prompt_token_ids=ids)
        if p.get("cache_salt"):
            prompt["cache_salt"] = p["cache_salt"]
        params = SamplingParams(temperature=0.0, max_tokens=p.get("max_tokens", 16),
                                ignore_eos=True)
        t0 = time.monotonic()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        wall = time.monotonic() - t0
        m = out.metrics
        ttft = (m.first_token_ts - m.queued_ts) if m and m.first_token_ts else wall
        results.append({"prompt_tokens": len(ids),
                        "num_cached_tokens": out.num_cached_tokens or 0,
                        "output_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text, "ttft_s": ttft, "wall_s": wall})
    llm.llm_engine.do_log_stats()  # vLLM's interval log once more: the last prompts' stats
    # the engine's shutdown ends the connector's background saves: every block is
    # counted once its put has committed
    llm.llm_engine.engine_core.shutdown()
    store = sys.modules.get("kvpool.integrations.vllm.store")  # loaded by KVPoolConnector
    metrics = store.snapshot() if store else {}
    # the same counts as vLLM's stat loggers saw them, step by step
    vllm_metrics = store.snapshot(prometheus_client.REGISTRY, "vllm:kvpool_") if store else {}
    return {"startup_s": startup_s, "prompts": results, "metrics": metrics,
            "vllm_metrics": vllm_metrics}


def compare(out_path: str | None, question: str, max_tokens: int = 8, rounds: int = 2) -> dict:
    """The side-by-side figures of docs/bench.md, one fresh vLLM process per run.

    First instances fill kvpool and vLLM's bundled ExampleConnector (safetensors on
    local disk); then ``rounds`` rounds, each running in turn: a cold run without a
    connector, kvpool's second instance over shared memory, over TCP (``force_tcp``),
    and ExampleConnector's second instance. Interleaving puts each row under the same
    machine load; a row's figure is its median over rounds. Runs in vLLM's environment;
    each run's vLLM log is kept next to ``out_path`` (``<out_path>.logs/``).
    """
    import statistics
    import subprocess
    import tempfile
    from pathlib import Path

    from kvpool.engine.model_cli import model_folder
    from kvpool.launch import Cluster

    model = str(model_folder("smollm2"))
    prompts = [{"question": question, "max_tokens": max_tokens}]
    logs = Path(f"{out_path or 'vllm-compare'}.logs")
    logs.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp, Cluster(segment_size="1GiB") as cluster:
        def kvpool(**extra):
            return {"kv_connector": "KVPoolConnector", "kv_role": "kv_both",
                    "kv_connector_module_path": "kvpool.integrations.vllm",
                    "kv_connector_extra_config": {"master": cluster.master_addr, **extra}}
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": f"{tmp}/example"}}
        rows = {"cold (no connector)": None, "kvpool second instance (shm)": kvpool(),
                "kvpool second instance (force_tcp)": kvpool(force_tcp=True),
                "ExampleConnector second instance": example}
        plan = [("kvpool first instance", kvpool()), ("ExampleConnector first instance", example)]
        plan += [item for _ in range(rounds) for item in rows.items()]
        for i, (name, conn) in enumerate(plan):
            job, out = f"{tmp}/job{i}.json", f"{tmp}/out{i}.json"
            with open(job, "w") as f:
                json.dump({"model": model, "connector": conn, "prompts": prompts}, f)
            with open(logs / f"{i:02d}.log", "w") as log:
                subprocess.run([sys.executable, "-m", "kvpool.bench.vllm", "run", job, out],
                               check=True, stdout=log, stderr=subprocess.STDOUT)
            with open(out) as f:
                r = json.load(f)["prompts"][0]
            runs.setdefault(name, []).append(r)
            print(f"{name:38s} TTFT {r['ttft_s']:7.3f} s  total {r['wall_s']:7.3f} s  "
                  f"cached {r['num_cached_tokens']}/{r['prompt_tokens']}", flush=True)
    cold_ids = runs["cold (no connector)"][0]["output_ids"]
    cold_ttft = statistics.median(r["ttft_s"] for r in runs["cold (no connector)"])
    summary = {}
    for name, rs in runs.items():
        ttft = statistics.median(r["ttft_s"] for r in rs)
        summary[name] = {"ttft_s": ttft, "ttft_runs_s": [r["ttft_s"] for r in rs],
                         "wall_s": statistics.median(r["wall_s"] for r in rs),
                         "num_cached_tokens": rs[0]["num_cached_tokens"],
                         "prompt_tokens": rs[0]["prompt_tokens"],
                         "ttft_ratio_vs_cold": cold_ttft / ttft,
                         "same_tokens_as_cold": all(r["output_ids"] == cold_ids for r in rs)}
    if out_path:
        with open(out_path, "w") as f:
            json.dump(summary, f, indent=1)
    return summary


def main(argv: list[str]) -> int:
    """``run JOB OUT`` (one instance) or ``compare [OUT]`` (the bench figures)."""
    if argv[:1] == ["run"] and len(argv) == 3:
        with open(argv[1]) as f:
            job = json.load(f)
        result = run_job(job)
        with open(argv[2], "w") as f:
            json.dump(result, f, indent=1)
        return 0
    if argv[:1] == ["compare"] and len(argv) <= 2:
        compare(argv[1] if len(argv) == 2 else None, load_workload()["questions"][0])
        return 0
    print("usage: python -m kvpool.bench.vllm run JOB.json OUT.json | compare [OUT.json]",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
