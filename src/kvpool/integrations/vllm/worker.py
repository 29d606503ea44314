"""Worker side of the connector: moves blocks between vLLM's paged KV and kvpool.

Load (``start_load_kv``, before the forward pass): every block planned this step, of
every request, is read with one ``batch_get_into`` into staging rows, each row's page
header is checked (namespace, page key, index, length, xxh3 checksum), and the good
pages are copied into vLLM's blocks with one ``index_copy_`` per layer. A block that is
missing or does not check is never copied; its id goes to
``get_block_ids_with_load_errors`` and vLLM recomputes from it (with
``kv_load_failure_policy: "recompute"``) or fails the request (``"fail"``).

Save: each layer's ``save_kv_layer`` copies the step's completed blocks of that layer
into staging pages; ``wait_for_save`` seals the headers and stores all of them with one
``batch_put_from`` before the step ends, so a request's KV is in kvpool before its
output reaches the user and vLLM may free its blocks at once.
"""

from __future__ import annotations

import re
import time

import torch

from kvpool.cache.keys import store_key
from kvpool.errors import ErrorCode
from kvpool.integrations.objects import PageRows, engine_page_key
from kvpool.integrations.vllm import layout as L
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.meta import BlockRun, KVPoolMetadata
from kvpool.integrations.vllm.store import (BLOCKS_LOADED, BLOCKS_SAVED, BYTES_LOADED,
                                            BYTES_SAVED, LOAD_ERRORS, SAVES_SKIPPED,
                                            GuardedStore)

MAX_STAGING_BYTES = 512 << 20  # pre-touched staging, at most (grown on demand beyond)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names) -> list[str]:
    """Layer names sorted by their layer number (``model.layers.<i>.self_attn.attn``)."""
    def index(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m[1]) if m else -1, name)
    return sorted(names, key=index)


class WorkerSide:
    """The connector in one vLLM worker (one tensor/pipeline rank)."""

    def __init__(self, keys: KeySpace, store: GuardedStore, tp_rank: int, pp_rank: int, log,
                 staging_rows: int = 128):
        self.keys, self.store, self.log = keys, store, log
        self.staging_rows = staging_rows
        self._staging = torch.empty((0, 0), dtype=torch.uint8)
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.views: dict[str, torch.Tensor] = {}
        self.index: dict[str, int] = {}
        self.page_shape: tuple[int, ...] = ()
        self.dtype = torch.float32
        self.layout = ""
        self._errors: set[int] = set()
        self._saves: list[BlockRun] = []
        self._rows: PageRows | None = None
        self._layers_saved: set[str] = set()
        self._incomplete_logged = False
        self._full_logged = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Block views of every layer; the stored page is ``[L, 2, H, B, D]``."""
        block_size = self.keys.block_size
        names = layer_order(kv_caches)
        first = kv_caches[names[0]]
        self.layout = L.detect_layout(first, block_size)
        self.views = {n: L.block_view(kv_caches[n], self.layout, block_size) for n in names}
        self.index = {n: i for i, n in enumerate(names)}
        self.page_shape = (len(names), *self.views[names[0]].shape[1:])
        self.dtype = first.dtype
        row_bytes = PageRows(0, self.page_shape, self.dtype).row_bytes
        self.staging_rows = max(1, min(self.staging_rows, MAX_STAGING_BYTES // row_bytes))
        self._staging = torch.zeros((self.staging_rows, row_bytes), dtype=torch.uint8)
        self.log.info("kvpool: %d layers of KV, layout %s %s %s, %d bytes per stored page, "
                      "staging for %d pages", len(names), self.layout, tuple(first.shape),
                      first.dtype, row_bytes, self.staging_rows)

    def _rows_for(self, n: int) -> PageRows:
        """Staging pages for ``n`` blocks: the worker's buffer, grown when a step needs more.
        Loads (before the forward) and saves (after it) of one step use it in turn."""
        rows = PageRows(n, self.page_shape, self.dtype, self._staging)
        if rows.buf.data_ptr() != self._staging.data_ptr():
            self._staging = rows.buf
        return rows

    def _digest(self, run: BlockRun) -> bytes:
        return self.keys.digest(self.tp_rank, self.pp_rank, run.cache_salt, run.lora)

    def _plan(self, runs: list[BlockRun]):
        """(vLLM block id, page header, store key) of every block of ``runs``."""
        rows = PageRows(0, self.page_shape, self.dtype)
        out = []
        for run in runs:
            digest = self._digest(run)
            for i, (h, block) in enumerate(zip(run.block_hashes, run.block_ids)):
                key = engine_page_key(digest, h)
                header = rows.header(digest, key, run.first_index + i, self.keys.block_size)
                out.append((block, header, store_key(key)))
        return out

    # ------------------------------------------------------------ load

    def start_load_kv(self, meta: KVPoolMetadata) -> None:
        """Load this step's planned blocks (synchronously, before the forward)."""
        plan = self._plan(meta.loads)
        if not plan:
            return
        t0 = time.perf_counter()
        # saves staged this step (a load after the forward) keep the staging buffer
        rows = (self._rows_for(len(plan)) if self._rows is None
                else PageRows(len(plan), self.page_shape, self.dtype))
        got = self.store.call("load", lambda c: c.batch_get_into([p[2] for p in plan], rows.rows()))
        if got is None:
            got = [-1] * len(plan)
        good = []
        for i, ((block, header, _), n) in enumerate(zip(plan, got)):
            why = rows.check(i, header, n)
            if why:
                LOAD_ERRORS.labels(why).inc()
                self._errors.add(block)
            else:
                good.append(i)
        if len(good) < len(plan):
            self._drop_bad_pages(plan, rows, got)
            self.log.warning("kvpool: %d of %d blocks failed to load (missing or failed their "
                             "page check); vLLM recomputes them", len(plan) - len(good), len(plan))
        if good:
            payload = rows.payload()
            payload = payload if len(good) == len(plan) else payload[good]
            ids = [plan[i][0] for i in good]
            for name, view in self.views.items():
                L.scatter_blocks(view, ids, payload[:, self.index[name]])
            BLOCKS_LOADED.inc(len(good))
            BYTES_LOADED.inc(len(good) * rows.row_bytes)
        self.log.info("kvpool: loaded %d of %d blocks (%.1f MB) in %.0f ms", len(good),
                      len(plan), len(good) * rows.row_bytes / 1e6,
                      1e3 * (time.perf_counter() - t0))

    def _drop_bad_pages(self, plan, rows: PageRows, got: list[int]) -> None:
        """Remove stored pages that were read but failed their check, so that the
        recomputed blocks can be saved in their place (a missing page needs nothing)."""
        bad = [key for i, ((_, header, key), n) in enumerate(zip(plan, got))
               if n >= 0 and rows.check(i, header, n)]
        if bad:
            self.store.call("remove", lambda c: c.batch_remove(bad, force=True))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._errors = self._errors, set()
        return errors

    # ------------------------------------------------------------ save

    def save_kv_layer(self, meta: KVPoolMetadata, layer_name: str) -> None:
        """Copy this layer's part of the step's completed blocks into staging pages."""
        if not meta.saves or layer_name not in self.views:
            return
        if self._rows is None:
            self._saves = meta.saves
            self._rows = self._rows_for(sum(len(r.block_ids) for r in self._saves))
            self._layers_saved = set()
        payload = self._rows.payload()[:, self.index[layer_name]]
        ids = [b for run in self._saves for b in run.block_ids]
        L.gather_blocks(self.views[layer_name], ids, payload)
        self._layers_saved.add(layer_name)

    def wait_for_save(self) -> None:
        """Seal and store the staging pages of this step (one batch put)."""
        rows, self._rows, saves, self._saves = self._rows, None, self._saves, []
        if rows is None:
            return
        plan = self._plan(saves)
        if len(self._layers_saved) != len(self.views):
            if not self._incomplete_logged:
                self.log.error("kvpool: only %d of %d layers reported their KV this step; "
                               "nothing saved", len(self._layers_saved), len(self.views))
                self._incomplete_logged = True
            SAVES_SKIPPED.labels("incomplete").inc(len(plan))
            return
        t0 = time.perf_counter()
        for i, (_, header, _) in enumerate(plan):
            rows.seal(i, header)
        keys = [p[2] for p in plan]
        bufs = rows.rows()
        codes = self.store.call("save", lambda c: c.batch_put_from(
            keys, bufs, [rows.row_bytes] * len(keys)))
        if codes is None:
            SAVES_SKIPPED.labels("unavailable").inc(len(keys))
            return
        stored = self._count_saves(codes, rows.row_bytes)
        self.log.debug("kvpool: saved %d of %d blocks in %.0f ms", stored, len(keys),
                       1e3 * (time.perf_counter() - t0))

    def _count_saves(self, codes, row_bytes: int) -> int:
        """Count a batch put's results; returns the blocks stored."""
        stored = sum(1 for c in codes if c == ErrorCode.OK)
        BLOCKS_SAVED.inc(stored)
        BYTES_SAVED.inc(stored * row_bytes)
        failed: dict[str, int] = {}
        for code in codes:
            if code != ErrorCode.OK:
                reason = "exists" if code == ErrorCode.OBJECT_ALREADY_EXISTS else (
                    "no_space" if code == ErrorCode.NO_AVAILABLE_HANDLE else ErrorCode(code).name.lower())
                failed[reason] = failed.get(reason, 0) + 1
        for reason, n in failed.items():
            SAVES_SKIPPED.labels(reason).inc(n)
        if "no_space" in failed:
            self._log_full(failed["no_space"], len(codes))
        return stored

    def _log_full(self, n: int, total: int) -> None:
        if not self._full_logged:
            self.log.warning("kvpool: store full, %d of %d blocks not saved; vLLM serves on and "
                             "later requests compute those blocks themselves", n, total)
            self._full_logged = True
