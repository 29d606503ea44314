"""Worker side of the connector: moves blocks between vLLM's paged KV and kvpool.

Load (``start_load_kv``, before the forward pass): every block planned this step, of
every request, is read with one ``batch_get_into`` into staging rows, each row's page
header is checked (namespace, page key, index, length, xxh3 checksum), and the good
pages are copied into vLLM's blocks with one ``index_copy_`` per layer. A block that is
missing or does not check is never copied; its id goes to
``get_block_ids_with_load_errors`` and vLLM recomputes from it (with
``kv_load_failure_policy: "recompute"``) or fails the request (``"fail"``). Loads stay
synchronous: this step's forward needs them.

Save (asynchronous, :mod:`kvpool.integrations.vllm.sender`): ``wait_for_save`` hands
the step's completed blocks to the background sender in batches and returns; the
sender copies each batch out of vLLM's blocks (every layer) into its own staging
pages, seals their headers and stores them with one ``batch_put_from``. A finished
request is named in ``get_finished`` (``finished_sending``) once no batch of it is
left, and vLLM frees its blocks only then (the scheduler side delayed the free).
A block counts as saved when its put has committed.
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
from kvpool.integrations.vllm.sender import Batch, Sender, split_runs
from kvpool.integrations.vllm.store import (BLOCKS_LOADED, BLOCKS_SAVED, BYTES_LOADED,
                                            BYTES_SAVED, FREES_DELAYED, LOAD_ERRORS,
                                            SAVES_SKIPPED, GuardedStore)

MAX_STAGING_BYTES = 512 << 20  # pre-touched staging, at most (grown on demand beyond)
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_order(names) -> list[str]:
    """Layer names sorted by their layer number (``model.layers.<i>.self_attn.attn``)."""
    def index(name: str) -> tuple[int, str]:
        m = _LAYER_INDEX.search(name)
        return (int(m[1]) if m else -1, name)
    return sorted(names, key=index)


class WorkerSide:
    """The connector in one vLLM worker (one tensor/pipeline rank).

    Args:
        keys, store: the deployment's KeySpace and the guarded kvpool client.
        tp_rank, pp_rank: this worker's ranks (each stores its own object per block).
        log: vLLM's logger.
        staging_rows: pages of each staging buffer (loads; saves), capped at
            MAX_STAGING_BYTES; a save batch holds at most that many blocks.
        max_batches: save batches queued at most; a step whose saves find the queue
            full does not save them (``kvpool_vllm_saves_skipped{reason="backlog"}``).
    """

    def __init__(self, keys: KeySpace, store: GuardedStore, tp_rank: int, pp_rank: int, log,
                 staging_rows: int = 128, max_batches: int = 8):
        self.keys, self.store, self.log = keys, store, log
        self.staging_rows = staging_rows
        self._staging = torch.empty((0, 0), dtype=torch.uint8)
        self._save_staging = torch.empty((0, 0), dtype=torch.uint8)
        self.tp_rank, self.pp_rank = tp_rank, pp_rank
        self.views: dict[str, torch.Tensor] = {}
        self.index: dict[str, int] = {}
        self.page_shape: tuple[int, ...] = ()
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self.layout = ""
        self._errors: set[int] = set()
        self.sender = Sender(self._copy_out, self._store, log, max_batches)
        self._saving: set[str] = set()  # requests with saves handed over, not yet reported
        self._ended: set[str] = set()  # of those, finished in vLLM: report when none is left
        self._full_logged = False
        self._backlog_logged = False

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Block views of every layer; the stored page is ``[L, 2, H, B, D]``."""
        block_size = self.keys.block_size
        names = layer_order(kv_caches)
        first = kv_caches[names[0]]
        self.layout = L.detect_layout(first, block_size)
        self.views = {n: L.block_view(kv_caches[n], self.layout, block_size) for n in names}
        self.index = {n: i for i, n in enumerate(names)}
        self.page_shape = (len(names), *self.views[names[0]].shape[1:])
        self.dtype, self.device = first.dtype, first.device
        row_bytes = PageRows(0, self.page_shape, self.dtype).row_bytes
        self.staging_rows = max(1, min(self.staging_rows, MAX_STAGING_BYTES // row_bytes))
        self._staging = torch.zeros((self.staging_rows, row_bytes), dtype=torch.uint8)
        self.log.info("kvpool: %d layers of KV, layout %s %s %s, %d bytes per stored page, "
                      "staging for %d pages", len(names), self.layout, tuple(first.shape),
                      first.dtype, row_bytes, self.staging_rows)

    def _rows_for(self, n: int) -> PageRows:
        """Staging pages for ``n`` blocks to load: the worker's buffer, grown when a step
        needs more (the step thread's; the sender has its own)."""
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
        rows = self._rows_for(len(plan))
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

    def wait_for_save(self, meta: KVPoolMetadata) -> None:
        """Hand this step's completed blocks to the sender (batches of at most
        ``staging_rows`` blocks) and return; nothing is copied on vLLM's thread."""
        if not meta.saves:
            return
        ready = self._step_written()
        for runs in split_runs(meta.saves, self.staging_rows):
            batch = Batch(runs, ready)
            if not self.sender.submit(batch):
                SAVES_SKIPPED.labels("backlog").inc(batch.blocks)
                if not self._backlog_logged:
                    self.log.warning("kvpool: %d save batches are still in flight; %d blocks "
                                     "of this step are not saved", self.sender.max_batches,
                                     batch.blocks)
                    self._backlog_logged = True
        self._saving.update(r.req_id for r in meta.saves)

    def _step_written(self):
        """A wait for the KV this step wrote, for the sender thread: a CUDA event on the
        current stream for a device cache; None on the CPU (the forward has returned)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event.synchronize

    def _copy_out(self, batch: Batch) -> tuple[PageRows, float]:
        """(Sender thread) the batch's blocks, every layer, into the sender's staging."""
        t0 = time.perf_counter()
        if self._save_staging.shape[0] < self.staging_rows:  # once: zeroed, pages faulted in
            self._save_staging = torch.zeros((self.staging_rows, self._staging.shape[1]),
                                             dtype=torch.uint8)
        rows = PageRows(batch.blocks, self.page_shape, self.dtype, self._save_staging)
        payload = rows.payload()
        ids = [b for run in batch.runs for b in run.block_ids]
        for name, view in self.views.items():
            L.gather_blocks(view, ids, payload[:, self.index[name]])
        return rows, t0

    def _store(self, batch: Batch, copied: tuple[PageRows, float]) -> None:
        """(Sender thread) seal the staged pages and store them with one batch put."""
        rows, t0 = copied
        plan = self._plan(batch.runs)
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
        self.log.info("kvpool: saved %d of %d blocks (%.1f MB) in %.0f ms", stored, len(keys),
                      stored * rows.row_bytes / 1e6, 1e3 * (time.perf_counter() - t0))

    def get_finished(self, finished_req_ids: set[str]) -> set[str]:
        """Requests to name in ``finished_sending``: those vLLM finished (now or earlier)
        that had saves handed over, once no batch of theirs is left."""
        ended = (set(finished_req_ids) & self._saving) - self._ended
        FREES_DELAYED.inc(sum(1 for r in ended if self.sender.pending(r)))
        self._ended |= ended
        done = {r for r in self._ended if not self.sender.pending(r)}
        self._ended -= done
        self._saving -= done
        return done

    def handle_preemptions(self, meta: KVPoolMetadata) -> None:
        """vLLM has freed the blocks of preempted requests and writes them in this step:
        their blocks still queued are not saved, a copy of them in progress is awaited."""
        preempted = set(meta.preempted) & self._saving
        if preempted:
            SAVES_SKIPPED.labels("preempted").inc(self.sender.drop(preempted))

    def close(self) -> None:
        """Save what is queued (within the sender's drain time), then stop the sender."""
        if not self.sender.close(self.sender.drain_s):
            self.log.warning("kvpool: save batches still in flight after %.0f s at shutdown; "
                             "they may not be stored", self.sender.drain_s)

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
