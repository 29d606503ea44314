"""Store keys of vLLM blocks: vLLM's own block hashes inside a kvpool namespace.

vLLM's block hashes (``request.block_hashes``, ``vllm/v1/core/kv_cache_utils.py``) chain
the token ids, the LoRA adapter and the request's ``cache_salt`` from a seed; with the
cryptographic algorithms (``sha256``, the default, and ``sha256_cbor``) the seed is
``PYTHONHASHSEED`` or a fixed string, so two processes agree (``kvpool.cache.compat``
recomputes them). kvpool binds each hash to a :class:`~kvpool.cache.namespace.Namespace`
made of everything else that changes the bytes of a block: model and weights, KV dtype,
block size, layout, tensor/pipeline rank and size, salt and LoRA (K13), and what vLLM
changes of the model on top of its files (``hf_overrides``, e.g. a RoPE theta; online
``quantization``): a trial found an instance started with ``--hf-overrides`` loading
the blocks of one without, and answering differently from its own computation.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from kvpool.cache.namespace import Namespace
from kvpool.engine.models import model_fingerprint
from kvpool.integrations.objects import engine_store_keys

# Algorithms whose block hashes are reproducible across processes (vLLM's
# _NON_CRYPTO_HASH_FUNCTIONS get a random seed unless PYTHONHASHSEED is set).
REPRODUCIBLE_HASHES = ("sha256", "sha256_cbor")


class KeySpace:
    """Namespaces and store keys of one vLLM deployment (one per connector).

    Args:
        model: the model path or name vLLM serves.
        dtype: KV dtype name ("float32", "bfloat16", "fp8", ...).
        block_size: tokens per vLLM block.
        device: vLLM's device type ("cpu", "cuda"), part of the layout name.
        tp_size, pp_size: parallel sizes; hash_algo: vLLM's prefix_caching_hash_algo.
        group: the KV cache group of a hybrid model ("" for a model with one group).
        changes: :func:`model_changes` of the deployment ("" when vLLM serves the model's
            files as they are).
    """

    def __init__(self, model: str, dtype: str, block_size: int, device: str, tp_size: int = 1,
                 pp_size: int = 1, hash_algo: str = "sha256", revision: str | None = None,
                 group: str = "", changes: str = ""):
        path = Path(model)
        self.model = path.name if path.is_dir() else model
        self.fingerprint = model_fingerprint(model, revision)
        self.dtype, self.block_size, self.device = dtype, block_size, device
        self.tp_size, self.pp_size, self.hash_algo = tp_size, pp_size, hash_algo
        self.group, self.changes = group, changes

    @functools.lru_cache(maxsize=1024)
    def digest(self, tp_rank: int, pp_rank: int, cache_salt: str, lora: str) -> bytes:
        """The namespace digest of one rank, salt and LoRA adapter (32 bytes)."""
        return Namespace(
            model=self.model, weights_fingerprint=self.fingerprint, dtype=self.dtype,
            page_size=self.block_size, kv_layout=f"layer_first/vllm-{self.device}",
            tp_rank=tp_rank, tp_size=self.tp_size, pp_rank=pp_rank, pp_size=self.pp_size,
            cache_salt=cache_salt, lora=lora,
            extra=("vllm-block-hash", self.hash_algo) + ((self.group,) if self.group else ())
            + (("changes", self.changes) if self.changes else ()),
        ).digest()

    def ranks(self) -> list[tuple[int, int]]:
        """Every (tp_rank, pp_rank) that stores its own object per block."""
        return [(t, p) for p in range(self.pp_size) for t in range(self.tp_size)]

    def store_keys(self, hashes, tp_rank: int, pp_rank: int, cache_salt: str,
                   lora: str) -> list[str]:
        """Store object names of vLLM block hashes for one rank."""
        return engine_store_keys(self.digest(tp_rank, pp_rank, cache_salt, lora), hashes)


def model_changes(hf_overrides, quantization) -> str:
    """What vLLM changes of a model on top of its files, as a canonical string for the
    namespace ("" for nothing): ``hf_overrides`` (a dict, or a callable named by its
    module and qualified name, the same in every process) and the online
    ``quantization`` method (None or a name)."""
    changes = {}
    if hf_overrides:
        changes["hf_overrides"] = hf_overrides if isinstance(hf_overrides, dict) else _callable_name(hf_overrides)
    if quantization:
        changes["quantization"] = str(quantization)
    return json.dumps(changes, sort_keys=True, default=str) if changes else ""


def _callable_name(fn) -> str:
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"
