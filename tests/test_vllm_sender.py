"""The vLLM connector's background sender on its own (no vLLM): order, pending requests,
a bounded queue, failures that do not stop it, preemption, and batches cut to size."""

from __future__ import annotations

import dataclasses
import logging
import threading

from kvpool.integrations.vllm.sender import Batch, Sender, split_runs
from kvpool.integrations.vllm.store import snapshot

WAIT_S = 30  # deadline of every wait on the sender thread (it returns at once when well)


@dataclasses.dataclass
class Run:
    """The fields of a BlockRun (whose module needs vLLM)."""

    req_id: str
    first_index: int
    block_hashes: list
    block_ids: list
    cache_salt: str = ""
    lora: str = ""


def run(req_id: str, ids: list[int], first: int = 0) -> Run:
    return Run(req_id, first, [bytes([i]) * 32 for i in ids], list(ids))


class Recorder:
    """copy_out/store callables that record what they saw; a gate holds copy_out."""

    def __init__(self):
        self.copied: list[list[str]] = []
        self.stored: list[list[int]] = []
        self.gate = threading.Event()
        self.gate.set()
        self.entered = threading.Event()

    def copy_out(self, batch: Batch):
        self.entered.set()
        assert self.gate.wait(WAIT_S)
        self.copied.append(sorted(batch.req_ids))
        return [b for r in batch.runs for b in r.block_ids]

    def store(self, batch: Batch, pages):
        self.stored.append(pages)


def skipped(reason: str) -> float:
    return snapshot().get(f"kvpool_vllm_saves_skipped_total{{reason={reason}}}", 0.0)


def test_batches_are_saved_in_order_and_a_request_is_pending_until_its_last_is_stored():
    rec = Recorder()
    rec.gate.clear()
    sender = Sender(rec.copy_out, rec.store, logging.getLogger("test"))
    assert sender.submit(Batch([run("a", [1, 2])]))
    assert sender.submit(Batch([run("a", [3]), run("b", [4])]))
    assert rec.entered.wait(WAIT_S)
    assert sender.pending("a") and sender.pending("b") and not sender.pending("c")
    rec.gate.set()
    assert sender.close(WAIT_S)
    assert rec.stored == [[1, 2], [3, 4]]
    assert not sender.pending("a") and not sender.pending("b")
    assert not sender.submit(Batch([run("c", [5])]))  # closed


def test_a_full_queue_refuses_a_batch():
    rec = Recorder()
    rec.gate.clear()
    sender = Sender(rec.copy_out, rec.store, logging.getLogger("test"), max_batches=1)
    assert sender.submit(Batch([run("a", [1])]))
    assert rec.entered.wait(WAIT_S)  # the first batch left the queue: one more fits
    assert sender.submit(Batch([run("b", [2])]))
    assert not sender.submit(Batch([run("c", [3])]))
    assert not sender.pending("c")
    rec.gate.set()
    assert sender.close(WAIT_S)
    assert rec.stored == [[1], [2]]


def test_a_failing_store_is_logged_once_counted_and_the_sender_goes_on(caplog):
    stored = []

    def store(batch, pages):
        if "bad" in batch.req_ids:
            raise RuntimeError("store exploded")
        stored.append(pages)

    before = skipped("error")
    sender = Sender(lambda b: [r.block_ids for r in b.runs], store, logging.getLogger("test"))
    with caplog.at_level(logging.ERROR, logger="test"):
        for batch in (Batch([run("bad", [1, 2])]), Batch([run("bad", [3])]),
                      Batch([run("good", [4])])):
            assert sender.submit(batch)
        assert sender.close(WAIT_S)
    assert stored == [[[4]]]
    assert skipped("error") - before == 3
    assert [r.levelno for r in caplog.records if "store exploded" in r.getMessage()] == [
        logging.ERROR]
    assert not sender.pending("bad")


def test_drop_takes_a_preempted_request_out_of_queued_batches():
    rec = Recorder()
    rec.gate.clear()
    sender = Sender(rec.copy_out, rec.store, logging.getLogger("test"))
    assert sender.submit(Batch([run("busy", [1])]))
    assert rec.entered.wait(WAIT_S)
    assert sender.submit(Batch([run("p", [2, 3]), run("q", [4])]))
    assert sender.submit(Batch([run("p", [5])]))
    assert sender.drop({"p"}) == 3  # queued only: the batch being copied is not p's
    assert not sender.pending("p") and sender.pending("q")
    rec.gate.set()
    assert sender.close(WAIT_S)
    assert rec.stored == [[1], [4]]


def test_drop_waits_for_a_copy_of_the_request_in_progress():
    rec = Recorder()
    rec.gate.clear()
    sender = Sender(rec.copy_out, rec.store, logging.getLogger("test"))
    assert sender.submit(Batch([run("p", [1])]))
    assert rec.entered.wait(WAIT_S)
    dropped = []
    waiter = threading.Thread(target=lambda: dropped.append(sender.drop({"p"})))
    waiter.start()
    waiter.join(0.05)
    assert waiter.is_alive()  # still copying p's block: drop must not return yet
    rec.gate.set()
    waiter.join(WAIT_S)
    assert dropped == [0] and rec.copied == [["p"]]
    assert sender.close(WAIT_S)


def test_split_runs_cuts_batches_to_size_and_keeps_block_indexes():
    batches = split_runs([run("a", [10, 11, 12], first=4), run("b", [20, 21])], 2)
    assert [[(r.req_id, r.first_index, r.block_ids) for r in b] for b in batches] == [
        [("a", 4, [10, 11])], [("a", 6, [12]), ("b", 0, [20])], [("b", 1, [21])]]
    assert batches[1][0].block_hashes == [bytes([12]) * 32]
    assert split_runs([], 4) == []
