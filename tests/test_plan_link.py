"""Fetch or recompute: the planner's link model, its crossover, `plan prefill --link-gbit`,
and the connector's policy that skips a hit whose fetch would be slower."""

from __future__ import annotations

import json

import pytest

from kvpool.cli import main
from kvpool.errors import UserError
from kvpool.integrations.fetch_policy import FetchPolicy
from kvpool.plan import configs_dir, load_spec
from kvpool.plan.link import TCP_PAYLOAD_SHARE, Link, crossover, fetch_gain
from kvpool.plan.prefill import Rates

SPEC = load_spec("smollm2-135m")
RATES = Rates(linear=170e9, attention=150e9)


def test_link_payload_bandwidth_and_latency():
    link = Link(10, delay_ms=0.1)
    assert link.bandwidth == pytest.approx(10e9 / 8 * TCP_PAYLOAD_SHARE)
    assert link.latency_s == pytest.approx(3 * 2 * 0.1e-3)
    for bad in ({"gbit": 0}, {"gbit": -1}, {"gbit": 1, "delay_ms": -0.1}):
        with pytest.raises(UserError):
            Link(**bad)


@pytest.mark.parametrize("gbit", [0.05, 0.2, 1.0])
def test_crossover_is_where_the_gain_turns_positive(gbit):
    link = Link(gbit, delay_ms=0.5)
    cross = crossover(SPEC, RATES, link, "fp32", suffix=32, max_prefix=8192)
    if cross is None:
        assert fetch_gain(SPEC, 8192, 32, RATES, link, "fp32") <= 0
        return
    assert fetch_gain(SPEC, cross, 32, RATES, link, "fp32") > 0
    assert fetch_gain(SPEC, cross - 1, 32, RATES, link, "fp32") <= 0
    # beyond it fetching keeps winning (convex gain, negative at 0)
    assert all(fetch_gain(SPEC, p, 32, RATES, link, "fp32") > 0
               for p in range(cross, 8193, 509))


def test_a_slower_link_moves_the_crossover_up():
    crosses = [crossover(SPEC, RATES, Link(g), "fp32", 32, 1 << 17) for g in (0.2, 0.15, 0.12)]
    assert None not in crosses and crosses == sorted(crosses) and crosses[0] < crosses[-1]
    # a link too slow for any prefix up to 512 tokens
    assert crossover(SPEC, RATES, Link(0.01), "fp32", 32, 512) is None


def test_plan_prefill_link_argument_prints_the_crossover(capsys):
    assert main(["plan", "prefill", "smollm2-135m", "--prompt", "2048", "--hit", "0.9",
                 "--kv-dtype", "fp32", "--link-gbit", "0.2", "--link-delay-ms", "0.1",
                 "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    link = doc["link"]
    assert link["gbit"] == 0.2 and link["latency_ms"] == pytest.approx(0.6)
    assert doc["rates"]["bandwidth"] == pytest.approx(0.2e9 / 8 * TCP_PAYLOAD_SHARE)
    rates = Rates(**doc["rates"])
    assert link["crossover_prefix_tokens"] == crossover(
        SPEC, rates, Link(0.2, 0.1), "fp32", link["suffix_tokens"], link["searched_up_to"])
    assert main(["plan", "prefill", "smollm2-135m", "--prompt", "2048", "--link-gbit", "1"]) == 0
    assert "fetching beats recomputing for prefixes of >=" in capsys.readouterr().out


def test_plan_prefill_refuses_bandwidth_and_link_together(capsys):
    assert main(["plan", "prefill", "smollm2-135m", "--prompt", "100", "--bandwidth", "5",
                 "--link-gbit", "1"]) == 2
    err = capsys.readouterr().err
    assert "not both" in err and "Traceback" not in err


def _config() -> dict:
    return json.loads((configs_dir() / "smollm2-135m.json").read_text())


def test_policy_skips_a_fetch_predicted_slower_than_recompute():
    slow = FetchPolicy.from_config({"link_gbit": 0.01}, _config(), "float32")
    fast = FetchPolicy.from_config({"link_gbit": 25}, _config(), "float32")
    # 512 tokens found after 0 computed, in a 600-token prompt
    assert slow.fetch_s(512) > slow.recompute_s(600, 0, 512)
    assert not slow.worth_fetching(600, 0, 512)
    assert fast.worth_fetching(600, 0, 512)
    # the decision follows the prediction, also after a local hit
    assert slow.worth_fetching(600, 64, 448) == (slow.fetch_s(448) < slow.recompute_s(600, 64, 448))


def test_policy_defaults_and_switch():
    default = FetchPolicy.from_config({}, _config(), "float32")
    assert default is not None and default.bandwidth == pytest.approx(5e9)
    assert default.worth_fetching(2048, 0, 2016)  # SmolLM2 on a CPU: loading wins
    assert FetchPolicy.from_config({"skip_slow_fetch": False}, _config(), "float32") is None
    with pytest.raises(UserError):
        FetchPolicy.from_config({"bandwidth_gbps": 0}, _config(), "float32")
    with pytest.raises(UserError):
        FetchPolicy.from_config({}, {"model_type": "llama"}, "float32")


def test_policy_refuses_a_value_that_is_not_a_number():
    # null reads as absent (the default), as for every key of an engine's extra config
    for extra in ({"link_gbit": "fast"}, {"linear_gflops": "none"}, {"link_gbit": -1}, {"linear_gflops": 0}):
        with pytest.raises(UserError):
            FetchPolicy.from_config(extra, _config(), "float32")
