"""The namespace of the vLLM connector's store keys (no vLLM needed): what vLLM changes of
a model on top of its files is part of it."""

from __future__ import annotations

from kvpool.integrations.vllm.keys import KeySpace, model_changes

ROPE = {"rope_parameters": {"rope_theta": 1000.0, "rope_type": "default"}}


def _digest(**kw) -> bytes:
    return KeySpace("SmolLM2-test", "float32", 32, "cpu", **kw).digest(0, 0, "", "")


def _rope_override(config):
    return config


def test_model_files_served_as_they_are_change_nothing():
    assert model_changes(None, None) == model_changes({}, "") == ""
    assert _digest(changes="") == _digest()


def test_hf_overrides_and_online_quantization_give_other_namespaces():
    plain = _digest()
    rope = _digest(changes=model_changes(ROPE, None))
    fp8 = _digest(changes=model_changes(None, "fp8"))
    assert len({plain, rope, fp8}) == 3
    same = {"rope_parameters": {"rope_type": "default", "rope_theta": 1000.0}}  # other key order
    assert _digest(changes=model_changes(same, None)) == rope


def test_a_callable_override_is_named_the_same_in_every_process():
    assert model_changes(_rope_override, None) == model_changes(_rope_override, None)
    assert "_rope_override" in model_changes(_rope_override, None)
