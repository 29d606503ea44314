"""Cache namespaces: everything that changes the bytes of a KV page.

KV is model state, not text (DESIGN.md, judgement 1): the same tokens under another
model, weights, dtype, layout, parallel rank, LoRA adapter, tenant salt or multimodal
input give different KV. Every page key chain starts from the namespace digest, so pages
of two namespaces can never share a key at any tier.
"""

from __future__ import annotations

import dataclasses
import hashlib
import struct

from kvpool.errors import InvalidParams

# Bump when the canonical encoding below changes: old keys then simply stop matching.
NAMESPACE_ENCODING_VERSION = 1
_MAGIC = b"kvpool-namespace"


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Identity of one KV-cache namespace.

    Fields:
        model: model name or path as the engine names it.
        weights_fingerprint: revision or hash of the weights (two revisions never share KV).
        dtype: KV dtype name, e.g. "float32", "bfloat16".
        page_size: tokens per page (> 0).
        kv_layout: engine-side page layout, e.g. "layer_first", "page_first".
        object_layout: how one page is split into store objects, e.g. "page" (one object)
            or "kv" (one object for K and one for V).
        tp_rank, tp_size, pp_rank, pp_size: tensor / pipeline parallel position; a rank
            holds a head slice (TP) or layer slice (PP), so each is its own namespace.
        cache_salt: tenant or request salt; different salts never share KV.
        lora: LoRA adapter identity ("" for none).
        extra: further keys as strings, e.g. hashes of multimodal inputs.

    Raises InvalidParams on an impossible combination (page_size <= 0, rank >= size, ...).
    """

    model: str
    weights_fingerprint: str = ""
    dtype: str = "float32"
    page_size: int = 16
    kv_layout: str = "layer_first"
    object_layout: str = "page"
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cache_salt: str = ""
    lora: str = ""
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra", tuple(self.extra))
        if not self.model:
            raise InvalidParams("namespace needs a model name")
        if self.page_size <= 0:
            raise InvalidParams(f"page_size must be > 0, got {self.page_size}")
        for rank, size, what in ((self.tp_rank, self.tp_size, "tp"),
                                 (self.pp_rank, self.pp_size, "pp")):
            if size < 1 or not 0 <= rank < size:
                raise InvalidParams(f"{what}_rank {rank} is not in [0, {what}_size={size})")
        for item in self.extra:
            if not isinstance(item, str):
                raise InvalidParams(f"namespace extra keys must be str, got {item!r}")

    def encode(self) -> bytes:
        """Canonical byte encoding (version 1), stable across processes, hosts, Pythons.

        Layout: b"kvpool-namespace", uint16 LE version, then for every field in
        declaration order: length-prefixed name, a type tag (b"s" str, b"i" int, b"t" tuple
        of str with a uint32 count), and length-prefixed UTF-8 value(s). Lengths are uint32 LE.
        """
        out = [_MAGIC, struct.pack("<H", NAMESPACE_ENCODING_VERSION)]
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            out.append(_lp(field.name.encode()))
            if isinstance(value, tuple):
                out.append(b"t" + struct.pack("<I", len(value)))
                out.extend(_lp(v.encode()) for v in value)
            elif isinstance(value, int):
                out.append(b"i" + _lp(str(value).encode()))
            else:
                out.append(b"s" + _lp(str(value).encode()))
        return b"".join(out)

    def digest(self) -> bytes:
        """SHA-256 of :meth:`encode` (32 bytes): the seed ``h_0`` of every page key chain."""
        return hashlib.sha256(self.encode()).digest()


def _lp(data: bytes) -> bytes:
    return struct.pack("<I", len(data)) + data
