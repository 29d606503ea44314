"""One vLLM instance as a measured process: the harness of kvpool's vLLM tests and bench.

``python -m kvpool.bench.vllm JOB.json OUT.json`` starts ``vllm.LLM`` (engine in this
process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the connector's counters are readable
here) with the job's KV connector, runs its prompts one after another and writes, per
prompt, the greedy output token ids, vLLM's ``num_cached_tokens``, the TTFT (engine
timestamps: first token minus queued) and the wall time of the whole request.

JOB: {"model": folder, "connector": null | kv_transfer_config dict,
      "prompts": [{"question": str, "max_tokens": int, "cache_salt": str | null}],
      "vllm": {extra vllm.LLM keyword arguments}}
Needs vLLM (``scripts/setup-vllm.sh``); this module imports it only in :func:`run_job`.
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
    """Run one instance (see module docstring); returns {"prompts": [...], "metrics": {...}}."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
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
        ids = chat_prompt_ids(tokenizer, prompt_messages(p["question"]))
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
        results.append({"question": p["question"], "prompt_tokens": len(ids),
                        "num_cached_tokens": out.num_cached_tokens or 0,
                        "output_ids": list(out.outputs[0].token_ids),
                        "text": out.outputs[0].text, "ttft_s": ttft, "wall_s": wall})
    metrics = {}
    if job.get("connector", {}).get("kv_connector") != "ExampleConnector" and job.get("connector"):
        from kvpool.integrations.vllm.store import snapshot

        metrics = snapshot()
    return {"startup_s": startup_s, "prompts": results, "metrics": metrics}


def main(argv: list[str]) -> int:
    job_path, out_path = argv
    with open(job_path) as f:
        job = json.load(f)
    result = run_job(job)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
