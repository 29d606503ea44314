"""Figures of docs/cache.md "Hybrid models": bytes stored per request and TTFT.

Runs the reference engine on the tiny Qwen3-Next-style model (3 Gated DeltaNet layers +
1 full-attention layer) and on its dense twin (the same model with 4 full-attention
layers: same width, heads and head size), fp32 on the CPU, for one prompt of PROMPT
tokens followed by a short question:

- bytes stored per request: what the first request wrote to L3 (a DiskBackend in a
  temporary folder; object payloads and their 128-byte headers), per part;
- TTFT: the question after the prompt, warm (the prompt's pages and checkpoint in L1,
  and in a second engine from L3) against cold (no cache), median of REPEAT runs.

Usage: PYTHONPATH=src python scripts/hybrid-figures.py [--json out.json] [--png out.png]
       [--repeat 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile

import torch

from kvpool.cache import DiskBackend
from kvpool.engine.engine import Engine
from kvpool.engine.models import (TINY_MODELS, TINY_QWEN3_NEXT, LoadedModel, seed_weights,
                                  tiny_random_model, weights_fingerprint)

PROMPT, QUESTION, PAGE = 2000, 24, 16
BYTES = ("bytes_written_l3", "window_bytes_written_l3", "state_bytes_written_l3")


def dense_twin():
    """The tiny Qwen3-Next with every layer full attention, weights seeded alike."""
    from transformers import Qwen3NextForCausalLM

    config = TINY_MODELS[TINY_QWEN3_NEXT]().config
    config.layer_types = ["full_attention"] * config.num_hidden_layers
    return seed_weights(Qwen3NextForCausalLM(config)).eval()


def loaded(name: str, model) -> LoadedModel:
    return LoadedModel(name, model, None, weights_fingerprint(model), "float32")


def measure(model: LoadedModel, repeat: int, checkpoint_pages: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(100, 40000, (PROMPT,), generator=gen).tolist()
    with tempfile.TemporaryDirectory() as tmp:
        disk = DiskBackend(tmp, 1 << 30)
        a, b = Engine(model), Engine(model)
        for eng in (a, b):
            eng.build_cache(PAGE, 256 << 20, l3=disk, checkpoint_pages=checkpoint_pages)
        first = a.generate(prompt, max_new_tokens=1).ttft_ms  # prefills and stores the prompt
        a.cache.flush()
        stored = {k: a.cache.metrics[k] for k in BYTES if a.cache.metrics[k]}
        warm, l3, cold, reused = [], [], [], set()
        for i in range(repeat):
            question = torch.randint(100, 40000, (QUESTION,), generator=gen).tolist()
            full = prompt + question
            cold.append(a.generate(full, max_new_tokens=1, use_cache=False).ttft_ms)
            r = a.generate(full, max_new_tokens=1)
            warm.append(r.ttft_ms)
            reused.add(r.reused_tokens)
            if i == 0:  # b's first sight of the prompt: every part from L3
                l3.append(b.generate(full, max_new_tokens=1).ttft_ms)
        for eng in (a, b):
            eng.cache.close()
    return {"model": model.name, "checkpoint_pages": checkpoint_pages,
            "stored_bytes": stored, "stored_total": sum(stored.values()),
            "reused_tokens": sorted(reused), "ttft_first_ms": first,
            "ttft_cold_ms": statistics.median(cold),
            "ttft_warm_l1_ms": statistics.median(warm), "ttft_warm_l3_ms": l3[0]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--json")
    parser.add_argument("--png")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    hybrid = loaded(TINY_QWEN3_NEXT, tiny_random_model(name=TINY_QWEN3_NEXT))
    dense = loaded("tiny-qwen3-next-dense", dense_twin())
    rows = [measure(hybrid, args.repeat, c) for c in (4, 16)]
    rows.append(measure(dense, args.repeat, 4))
    print("| model | checkpoint pages | stored per request | reused | TTFT first (stores) | "
          "cold | warm L1 | warm L3 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cp = r["checkpoint_pages"] if r["model"] == TINY_QWEN3_NEXT else "-"
        print(f"| {r['model']} | {cp} | {r['stored_total']:,} B | {r['reused_tokens']} | "
              f"{r['ttft_first_ms']:.1f} ms | {r['ttft_cold_ms']:.1f} ms | {r['ttft_warm_l1_ms']:.1f} ms | "
              f"{r['ttft_warm_l3_ms']:.1f} ms |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)
    if args.png:
        plot(rows, args.png)


def plot(rows: list[dict], path: str) -> None:
    from kvpool.bench.plot import Panel, save_panels

    labels = [f"hybrid, checkpoint every {r['checkpoint_pages']} pages"
              if r["model"] == TINY_QWEN3_NEXT else "dense (4 full layers)" for r in rows]
    stored = Panel("bytes stored per request (L3 objects)", labels,
                   {"KB": [r["stored_total"] / 1e3 for r in rows]}, ylabel="KB")
    ttft = Panel("TTFT of a question after the prompt", labels,
                 {"cold": [r["ttft_cold_ms"] for r in rows],
                  "warm (L1)": [r["ttft_warm_l1_ms"] for r in rows],
                  "warm (L3, second engine)": [r["ttft_warm_l3_ms"] for r in rows]}, ylabel="ms")
    save_panels(path, [stored, ttft], f"tiny Qwen3-Next-style model, {PROMPT}-token prompt, fp32 CPU")


if __name__ == "__main__":
    main()
