"""Worker side of the connector: moves blocks between vLLM's paged KV and kvpool.

Load (``start_load_kv``, before the forward pass): one grant query for every block
planned this step, of every request. A page in a segment mapped in this process has its
header checked and is copied straight from the segment into vLLM's blocks, its checksum
checked meanwhile (:mod:`~kvpool.integrations.vllm.loader`); other pages are read into
staging rows, checked (namespace, page key, index, length, xxh3 checksum) and copied
with one ``index_copy_`` per layer. A block that is missing or does not check goes to
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
import threading
import time

import torch

from kvpool.cache.codec import HEADER_SIZE, PageFormatError, check_header
from kvpool.cache.keys import store_key
from kvpool.client.grants import ReadHandle
from kvpool.errors import ErrorCode
from kvpool.integrations.objects import PageRows, engine_page_key, unread_reason
from kvpool.integrations.vllm import layout as L
from kvpool.integrations.vllm.keys import KeySpace
from kvpool.integrations.vllm.loader import ViewLoader, prefault
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
        segment: the store segment to place saved blocks on first ("" = the master's).
        max_batches: save batches queued at most; a step whose saves find the queue
            full does not save them (``kvpool_vllm_saves_skipped{reason="backlog"}``).
        layerwise: copy viewed pages layer by layer beside the forward pass
            (:class:`~kvpool.integrations.vllm.loader.LayeredLoad`) instead of every
            layer in ``start_load_kv``. Off by default: on vLLM's CPU backend, whose
            OpenMP threads are pinned one per core, the copy thread shares a core with
            the forward pass and stalled it (docs/bench.md, "vLLM with kvpool").
    """

    def __init__(self, keys: KeySpace, store: GuardedStore, tp_rank: int, pp_rank: int, log,
                 staging_rows: int = 128, segment: str = "", max_batches: int = 8,
                 layerwise: bool = False):
        self.keys, self.store, self.log = keys, store, log
        self.segment = segment  # preferred segment of saves ("" = the master's choice)
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
        self._why: dict[str, int] = {}  # this load's failed blocks by reason, for its log line
        self._bad_keys: list[str] = []  # read but unusable: removed when the load ends
        self._loader = ViewLoader()
        self.layerwise = layerwise
        self._layered = None  # (LayeredLoad, plan, pages viewed, pages loaded staged, t0)
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
        threading.Thread(target=self._warm, args=(list(kv_caches.values()),),
                         name="kvpool-warm", daemon=True).start()
        self.log.info("kvpool: %d layers of KV, layout %s %s %s, %d bytes per stored page, "
                      "staging for %d pages", len(names), self.layout, tuple(first.shape),
                      first.dtype, row_bytes, self.staging_rows)

    def _warm(self, caches: list[torch.Tensor]) -> None:
        """Off the request path: fault in vLLM's cache pages and the same-host segments'
        page tables, which a fresh process's first load would otherwise pay for."""
        t0 = time.perf_counter()
        cache_bytes = prefault(caches)
        segment_bytes = self.store.call("warm", lambda c: c.warm_local_segments()) or 0
        self.log.info("kvpool: warmed %.0f MB of KV cache and %.0f MB of same-host segments "
                      "in %.0f ms", cache_bytes / 1e6, segment_bytes / 1e6,
                      1e3 * (time.perf_counter() - t0))

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
        """Load this step's planned blocks (before the forward): one grant query for all
        of them; pages in a segment mapped here are copied straight from it
        (:mod:`~kvpool.integrations.vllm.loader`; layer by layer while the forward pass
        runs, unless ``layerwise`` is off), the rest read into staging pages, checked and
        scattered here."""
        plan = self._plan(meta.loads)
        if not plan:
            return
        t0 = time.perf_counter()
        handles = self.store.call("load", lambda c: c.batch_query([p[2] for p in plan]))
        handles = handles or [None] * len(plan)  # None: kvpool unreachable now
        held = [i for i, h in enumerate(handles) if isinstance(h, ReadHandle)]
        for i in set(range(len(plan))) - set(held):
            self._load_failed(plan[i], "unavailable" if handles[i] is None else unread_reason(handles[i]))
        opened = self.store.call("load", lambda c: c.open_views([handles[i] for i in held]))
        items, staged = [], []
        for pos, i in enumerate(held):
            view = opened.views[pos] if opened else None
            if view is None:
                staged.append(i)
                continue
            why = self._check_view(view, plan[i][1])
            if isinstance(why, str):
                self._load_failed(plan[i], why, read=True)
            else:
                items.append((plan[i][0], pos, why))
        loaded = 0
        if staged:
            loaded += self._load_staged([plan[i] for i in staged], [handles[i] for i in staged])
        if items and self.layerwise:
            job = self._loader.start(self.views, self.index, opened, items, self.page_shape, self.dtype)
            self._layered = (job, plan, len(items), loaded, t0)
            return  # ended by get_block_ids_with_load_errors, after the forward pass
        loaded += self._load_viewed(plan, opened, items) if items else 0
        if opened and not items:
            opened.close()
        self._end_load(len(plan), loaded, t0)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until this step's layered load has copied layer ``layer_name``."""
        if self._layered is not None and layer_name in self.index:
            self._layered[0].wait_layer(self.index[layer_name])

    def _finish_layered(self) -> None:
        """End this step's layered load: count what landed and passed its checks."""
        if self._layered is None:
            return
        job, plan, viewed, loaded, t0 = self._layered
        self._layered = None
        bad = job.result()
        if "unwaited" in bad.values() and not any(job.waited):
            self.layerwise = False
            self.log.warning("kvpool: vLLM did not wait for layers to load; loading every "
                             "layer before the forward pass from now on")
        planned = {p[0]: p for p in plan}
        for block, why in bad.items():  # an unwaited page is sound: kept in the store
            self._load_failed(planned[block], why, read=why != "unwaited")
        self._end_load(len(plan), loaded + viewed - len(bad), t0)

    def _load_viewed(self, plan, opened, items) -> int:
        """Copy the viewed, header-checked pages ``items`` into vLLM's blocks; returns
        how many landed and passed their checks."""
        planned = {p[0]: p for p in plan}
        try:
            bad = self._loader.load(self.views, self.index, opened, items, self.page_shape,
                                    self.dtype)
        except Exception as exc:  # noqa: BLE001 - a failed copy is a load error, not vLLM's
            self.log.warning("kvpool: copying %d blocks out of shared memory failed (%s)",
                             len(items), exc)
            bad = {block: "error" for block, _, _ in items}
        for block, why in bad.items():
            self._load_failed(planned[block], why, read=True)
        return len(items) - len(bad)

    def _check_view(self, view: memoryview, header) -> int | str:
        """The payload checksum a viewed page's header records, or why it is unusable."""
        if len(view) != PageRows(0, self.page_shape, self.dtype).row_bytes:
            return "length"
        try:
            return check_header(view[:HEADER_SIZE], header)
        except PageFormatError as exc:
            return exc.reason

    def _load_failed(self, planned, why: str, read: bool = False) -> None:
        """Count block ``planned`` (vLLM block, header, key) as a load error; a page that
        was read but is unusable is removed afterwards, so the recomputed block can be
        saved in its place (a missing one needs nothing)."""
        LOAD_ERRORS.labels(why).inc()
        self._why[why] = self._why.get(why, 0) + 1
        self._errors.add(planned[0])
        if read:
            self._bad_keys.append(planned[2])

    def _load_staged(self, plan, handles) -> int:
        """Read ``plan``'s pages (granted by ``handles``) into staging pages, check them
        and scatter the good ones into vLLM's blocks (TCP, or no same-host replica);
        returns how many landed."""
        rows = self._rows_for(len(plan))
        got = self.store.call("load", lambda c: c.batch_read_into(handles, rows.rows()))
        good = []
        for i, (planned, n) in enumerate(zip(plan, got or [None] * len(plan))):
            why = "unavailable" if n is None else rows.check(i, planned[1], n)
            if why:
                self._load_failed(planned, why, read=n is not None and n >= 0)
            else:
                good.append(i)
        if good:
            payload = rows.payload()
            payload = payload if len(good) == len(plan) else payload[good]
            ids = [plan[i][0] for i in good]
            for name, view in self.views.items():
                L.scatter_blocks(view, ids, payload[:, self.index[name]])
        return len(good)

    def _end_load(self, total: int, loaded: int, t0: float) -> None:
        """Count what landed, remove pages that were read but failed their check (so
        the recomputed blocks can be saved in their place) and say so in vLLM's log."""
        if self._bad_keys:
            bad_keys, self._bad_keys = self._bad_keys, []
            self.store.call("remove", lambda c: c.batch_remove(bad_keys, force=True))
        row_bytes = PageRows(0, self.page_shape, self.dtype).row_bytes
        BLOCKS_LOADED.inc(loaded)
        BYTES_LOADED.inc(loaded * row_bytes)
        why, self._why = self._why, {}
        if loaded < total:
            self.log.warning("kvpool: %d of %d blocks failed to load (%s); vLLM recomputes them",
                             total - loaded, total, ", ".join(f"{n} {w}" for w, n in sorted(why.items())))
        self.log.info("kvpool: loaded %d of %d blocks (%.1f MB) in %.0f ms", loaded, total,
                      loaded * row_bytes / 1e6, 1e3 * (time.perf_counter() - t0))

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._finish_layered()
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
        have = self._save_staging.shape[0]
        if have < batch.blocks:  # grown as batches need: zeroed, so its pages are faulted in
            # once, a few rows at a time: zeroing all 256 rows of 1.47 MB at the first save
            # took 0.3-1 s here, beside the first request's decode steps
            n = min(self.staging_rows, max(batch.blocks, 2 * have))
            self._save_staging = torch.zeros((n, self._staging.shape[1]), dtype=torch.uint8)
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
            keys, bufs, [rows.row_bytes] * len(keys), preferred_segment=self.segment))
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

    def saving(self, req_id: str) -> bool:
        """True while saves of ``req_id`` were handed over and not yet reported done."""
        return req_id in self._saving

    def handle_preemptions(self, meta: KVPoolMetadata) -> None:
        """vLLM has freed the blocks of preempted requests and writes them in this step:
        their blocks still queued are not saved, a copy of them in progress is awaited."""
        preempted = set(meta.preempted) & self._saving
        if preempted:
            SAVES_SKIPPED.labels("preempted").inc(self.sender.drop(preempted))

    def close(self) -> None:
        """Save what is queued (within the sender's drain time), then stop the sender and
        the loader's threads."""
        self._finish_layered()
        self._loader.close()
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
