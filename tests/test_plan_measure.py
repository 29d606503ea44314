"""`kvpool plan prefill --measure` end to end on the tiny random model (no timing asserted)."""

from __future__ import annotations

import importlib
import json

import pytest

from kvpool.cli import main

# the tiny-random model of kvpool.engine: a 2-layer Llama, hidden 64, 4 heads of 16,
# 2 KV heads, MLP 128, SmolLM2's vocabulary
TINY_CONFIG = {"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 64,
               "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
               "head_dim": 16, "vocab_size": 49152}


@pytest.fixture()
def engine_ready():
    """Skips while the engine is not there; restores torch's thread count after."""
    engine = importlib.import_module("kvpool.engine")
    if not hasattr(engine, "Engine"):
        pytest.skip("kvpool.engine does not export Engine yet")
    import torch

    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_measure_writes_table_json_and_png(engine_ready, tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "measure"
    rc = main(["plan", "prefill", str(config), "--prompt", "128", "--measure",
               "--model", "tiny-random", "--kv-dtype", "fp32", "--repeats", "1",
               "--threads", "1", "--clock", "cpu", "--out", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "| 90% |" in text and "predicted TTFT ms" in text
    result = json.loads(out.with_suffix(".json").read_text())
    assert [r["hit"] for r in result["rows"]] == [0.0, 0.25, 0.5, 0.75, 0.9]
    assert [r["cached"] for r in result["rows"]] == [0, 32, 64, 96, 112]
    assert all(r["predicted_ms"] > 0 and r["measured_ms"] > 0 for r in result["rows"])
    assert result["threads"] == 1 and result["clock"] == "cpu"
    # the engine's default kernel is the causal split one; the masked one is the reference
    assert (result["attention_kernel"], result["other_kernel"]) == ("causal", "masked")
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_measure_predicts_the_masked_kernel_for_the_stock_sdpa_path(engine_ready, tmp_path,
                                                                    capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    out = tmp_path / "measure"
    rc = main(["plan", "prefill", str(config), "--prompt", "64", "--measure",
               "--model", "tiny-random", "--kv-dtype", "fp32", "--repeats", "1",
               "--threads", "1", "--engine-attention", "sdpa", "--out", str(out)])
    assert rc == 0
    assert "with a causal kernel ms" in capsys.readouterr().out
    result = json.loads(out.with_suffix(".json").read_text())
    assert (result["attention_kernel"], result["other_kernel"]) == ("masked", "causal")


def test_cpu_clock_needs_one_thread(engine_ready, tmp_path, capsys):
    config = tmp_path / "tiny.json"
    config.write_text(json.dumps(TINY_CONFIG))
    rc = main(["plan", "prefill", str(config), "--prompt", "64", "--measure",
               "--model", "tiny-random", "--threads", "2", "--clock", "cpu"])
    assert rc == 2
    assert "--threads 1" in capsys.readouterr().err


def test_measure_refuses_a_config_of_another_model(engine_ready, capsys):
    rc = main(["plan", "prefill", "llama-3-8b", "--prompt", "64", "--measure",
               "--model", "tiny-random", "--kv-dtype", "fp32", "--threads", "1"])
    assert rc == 2
    assert "does not describe the engine's model" in capsys.readouterr().err
