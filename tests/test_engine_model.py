"""Model loading and the page <-> transformers-cache layout of the reference engine."""

import json
import os
import subprocess
import sys
import time

import pytest
import torch

from kvpool.engine.engine import Engine
from kvpool.engine.kv import kv_buffer, page_shape, pages_to_cache, pages_view, seq_cache
from kvpool.engine.models import (
    file_fingerprint, folder_fingerprint, load_model, resolve_source, smollm2_gguf_path, weights_fingerprint,
    write_folder_atomically,
)
from kvpool.errors import UserError
from proc_helpers import wait_for


@pytest.fixture(scope="module")
def tiny():
    torch.set_num_threads(1)
    return load_model("tiny-random")


def test_pages_round_trip_through_the_transformers_cache(tiny):
    config = tiny.model.config
    shape = page_shape(config, 4)
    pages = torch.randn((3, *shape), generator=torch.Generator().manual_seed(0))
    cache = pages_to_cache(pages, config)
    assert cache.get_seq_length() == 12
    # token t of page p, layer l: keys at [l][0, :, 4p + t], values likewise
    for layer, (k, v) in enumerate((c.keys, c.values) for c in cache.layers):
        for p in range(3):
            assert torch.equal(k[0, :, 4 * p:4 * p + 4], pages[p, layer, 0])
            assert torch.equal(v[0, :, 4 * p:4 * p + 4], pages[p, layer, 1])
    # the same storage seen as pages: writes through the view land in the cache layout
    seq = kv_buffer(shape, 20, torch.float32)
    pages_view(seq, 3, 4).copy_(pages)
    assert torch.equal(pages_view(seq, 3, 4), pages)
    assert torch.equal(pages_view(seq, 2, 4), pages[:2])
    again = seq_cache(seq, 12, config)
    assert all(torch.equal(a.keys, b.keys) for a, b in zip(again.layers, cache.layers))


def test_cache_layers_write_new_tokens_in_place(tiny):
    config = tiny.model.config
    shape = page_shape(config, 4)
    seq = kv_buffer(shape, 10, torch.float32)
    cache = seq_cache(seq, 8, config)
    layer = cache.layers[0]
    new = torch.randn(1, shape[2], 2, shape[4])
    keys, values = layer.update(new, -new)
    assert cache.get_seq_length() == 10 and keys.shape[-2] == 10
    assert keys.data_ptr() == seq[0, 0].data_ptr()  # no copy of the cache
    assert torch.equal(seq[0, 0, :, :, 8:10], new) and torch.equal(seq[0, 1, :, :, 8:10], -new)
    # past the storage's capacity a layer still grows (by concatenation)
    keys, _ = layer.update(new, new)
    assert keys.shape[-2] == 12 and torch.equal(keys[..., 10:, :], new)


def test_reserve_allocates_the_kv_buffer_the_first_request_uses(tiny):
    engine = Engine(tiny)
    engine.reserve(0)
    assert engine._seq is None  # nothing reserved, nothing allocated
    engine.reserve(100)
    reserved = engine._seq
    assert reserved.shape[4] >= 100 and not reserved.any()  # touched: written with zeros
    engine.generate(list(range(5, 60)), max_new_tokens=2, use_cache=False)
    assert engine._seq is reserved  # the request found it large enough


def test_local_hf_folder_loads_with_the_same_weights(tiny, tmp_path):
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    folder = load_model(str(tmp_path))
    assert weights_fingerprint(folder.model) == tiny.fingerprint
    prompt = list(range(100, 140))
    a = Engine(tiny).generate(prompt, 4)
    b = Engine(folder).generate(prompt, 4)
    assert a.output_ids == b.output_ids
    # same weights; memory layout may change the kernels' summation order slightly
    assert torch.allclose(a.last_logits, b.last_logits, rtol=0, atol=1e-5)
    # the fingerprint of a folder is stable: computed twice from the files, it agrees
    assert load_model(str(tmp_path)).fingerprint == folder.fingerprint


def test_model_specs_are_classified():
    gguf = smollm2_gguf_path()
    assert resolve_source("smollm2") == ("gguf", "SmolLM2-135M-Instruct", gguf)
    # the same file by path: same name (and fingerprint), so the same cache namespace
    assert resolve_source(str(gguf)) == ("gguf", "SmolLM2-135M-Instruct", gguf)
    assert resolve_source("tiny-random") == ("tiny", "tiny-random", None)


def test_unknown_model_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="unknown model .*: no such file or folder"):
        resolve_source(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="unknown model"):
        resolve_source(str(tmp_path / "empty"))
    (tmp_path / "bad.gguf").write_bytes(b"garbage\n")
    with pytest.raises(UserError, match="not a GGUF file"):
        resolve_source(str(tmp_path / "bad.gguf"))


@pytest.mark.parametrize("command", [["generate", "--prompt", "hi"], ["demo"]])
def test_unknown_model_path_exits_2_with_a_message_and_no_traceback(command, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvpool", *command, "--model",
                           str(tmp_path / "no-such-model")], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "unknown model" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_cli_answers_a_prompt(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvpool", "generate", "--model", "tiny-random",
                           "--prompt", "Hello there", "--max-new-tokens", "3", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert len(result["output_ids"]) == 3
    assert result["reused_tokens"] == 0


def test_generate_from_a_converted_folder_draws_no_progress_bar(tiny, tmp_path):
    """Loading a safetensors folder (what every run after the first conversion does)
    prints the one "loading model" line, not transformers' "Loading weights" bar."""
    tiny.model.save_pretrained(tmp_path)
    tiny.tokenizer.save_pretrained(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "kvpool", "generate", "--model", str(tmp_path),
                           "--prompt", "Hello there", "--max-new-tokens", "1"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "loading model" in proc.stderr
    assert "Loading weights" not in proc.stderr and "\r" not in proc.stderr, proc.stderr


RACER = """
import os, sys, time
from pathlib import Path
from kvpool.engine.models import write_folder_atomically

def write(tmp):
    (tmp / "weights").write_text(str(os.getpid()))
    time.sleep(0.5)  # both processes are inside the conversion at the same time
    (tmp / "config").write_text(str(os.getpid()))

write_folder_atomically(Path(sys.argv[1]), "fp123", write)
"""


def test_two_processes_converting_at_once_leave_one_complete_folder(tmp_path):
    target = tmp_path / "models" / "m-fp123"
    racers = [subprocess.Popen([sys.executable, "-c", RACER, str(target)]) for _ in range(2)]
    assert [p.wait(timeout=60) for p in racers] == [0, 0]
    # one writer's complete folder, nothing mixed, no temporary folder left behind
    assert (target / "weights").read_text() == (target / "config").read_text()
    assert (target / "kvpool_fingerprint.txt").read_text().strip() == "fp123"
    assert sorted(p.name for p in target.parent.iterdir()) == ["m-fp123"]


def test_a_conversion_killed_midway_leaves_nothing_the_next_one_keeps(tmp_path):
    """A conversion killed with -9 left its temporary folder (513 MiB for SmolLM2)
    that no later run removed. The next conversion of the model removes folders whose
    writer is gone (their lock is free; one without a lock once an hour old) and
    keeps one whose writer still holds its lock."""
    target = tmp_path / "models" / "m-fp123"
    target.parent.mkdir(parents=True)
    killed = subprocess.Popen([sys.executable, "-c", RACER.replace("time.sleep(0.5)", "time.sleep(60)"),
                               str(target)])
    wait_for(lambda: len(list(target.parent.glob(".m-fp123.*/weights"))) == 1, 30, "the writer's folder")
    killed.kill()
    killed.wait(timeout=30)
    [left] = target.parent.glob(".m-fp123.*")
    old_unlocked = target.parent / ".m-fp123.older"
    old_unlocked.mkdir()
    os.utime(old_unlocked, (time.time() - 7200,) * 2)
    fresh_unlocked = target.parent / ".m-fp123.fresh"
    fresh_unlocked.mkdir()
    alive = subprocess.Popen([sys.executable, "-c", RACER.replace("time.sleep(0.5)", "time.sleep(60)"),
                              str(target)])
    try:
        wait_for(lambda: len(list(target.parent.glob(".m-fp123.*/weights"))) == 1
                 and not left.exists(), 30, "the abandoned folder removed")
        [writing] = target.parent.glob(".m-fp123.*/weights")
        write_folder_atomically(target, "fp123", lambda tmp: (tmp / "weights").write_text("mine"))
        assert writing.exists()  # a live writer's folder is kept
    finally:
        alive.kill()
        alive.wait(timeout=30)
    assert not old_unlocked.exists() and fresh_unlocked.exists()
    assert (target / "weights").read_text() == "mine"


def test_a_truncated_gguf_or_an_unusable_cache_folder_is_one_line_not_a_traceback(tmp_path):
    """Two first-run mistakes that printed chained tracebacks: a GGUF cut short (a
    download that stopped) and a KVPOOL_CACHE_DIR that is a file or cannot be made."""
    gguf = smollm2_gguf_path()
    cut = tmp_path / "cut.gguf"
    with gguf.open("rb") as src:
        cut.write_bytes(src.read(10 << 20))
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    env = {**os.environ, "KVPOOL_CACHE_DIR": str(tmp_path / "cache")}
    runs = [
        (["generate", "--model", str(cut), "--prompt", "hi"], env, "a truncated or damaged GGUF?"),
        (["model", "path", "smollm2"], {**env, "KVPOOL_CACHE_DIR": str(a_file)},
         "set KVPOOL_CACHE_DIR to a writable folder"),
    ]
    for args, run_env, said in runs:
        proc = subprocess.run([sys.executable, "-m", "kvpool", *args], capture_output=True, text=True,
                              env=run_env, timeout=300)
        assert proc.returncode == 2, proc.stderr
        assert said in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        if run_env is not env:  # no "first run: converting ..." promise before the refusal
            assert "converting" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    assert not list((tmp_path / "cache" / "models").iterdir())  # nothing half-written kept


def test_a_weight_changed_only_in_the_middle_of_its_file_changes_the_fingerprint(tmp_path, monkeypatch):
    """Found by a trial: the fingerprint hashed each file's first and last MiB, so a
    fine-tune that changed one middle layer kept the old model's namespace (and loaded
    its KV). Every byte counts now, and a folder's stale fingerprint file is not trusted."""
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    size = 4 << 20
    folders = []
    for name, poke in (("a", None), ("b", size // 2)):
        folder = tmp_path / name / "model"
        folder.mkdir(parents=True)
        data = bytearray(size)
        if poke is not None:
            data[poke] = 1
        (folder / "model.safetensors").write_bytes(data)
        (folder / "config.json").write_text("{}")
        (folder / "kvpool_fingerprint.txt").write_text("same-stale-value\n")
        folders.append(folder)
    a, b = (folder_fingerprint(f) for f in folders)
    assert a != b
    assert folder_fingerprint(folders[0]) == a  # stable, and now from the memo
    assert len(list((tmp_path / "cache" / "fingerprints").iterdir())) == 4


def test_a_file_rewritten_in_place_is_read_again_not_taken_from_the_memo(tmp_path, monkeypatch):
    monkeypatch.setenv("KVPOOL_CACHE_DIR", str(tmp_path / "cache"))
    weights = tmp_path / "w.safetensors"
    weights.write_bytes(b"\0" * 4096)
    before = file_fingerprint([weights])
    weights.write_bytes(b"\1" * 4096)
    os.utime(weights, ns=(1, 1))  # a new modification time, as any write gives
    assert file_fingerprint([weights]) != before
