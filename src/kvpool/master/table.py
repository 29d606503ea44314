"""The master's object records, stored as a struct of arrays.

A master holds millions of keys, so one key's record is not a Python object: it is one
slot across typed arrays (:mod:`array`), found through one ``dict`` from key to slot.
The common case (one COMPLETE replica, no put in flight, no read in flight) costs the
dict entry, the key string, the slot number and 68 bytes of arrays; rarer state sits in
side tables by slot: replica lists of other lengths (``more``), puts in flight
(``pending``) and the read grants of the current version (``grants``, dropped when the
last of them closes). Segment names are interned as 16-bit ids (at most
:data:`~kvpool.protocol.MAX_SEGMENTS` are mounted). The arrays also hold the eviction
order's links and keys (``prev``/``next``/``run``/``order``: sorted doubly-linked runs,
see :mod:`kvpool.master.eviction`), so that order costs 17 bytes per object and no object
of its own. Measured (``kvpool bench master``): docs/bench.md.

:class:`ObjectMeta` is a short-lived view of one slot with the attributes of a record
(``size``, ``replicas``, ``pending``, ``lease_deadline``, ...), read and written through
to the arrays. Views are made per request; none outlives the handler that made it.
"""

from __future__ import annotations

from array import array
from typing import Iterator

from kvpool.master.objects import Grants, PendingPut, Replica

NO_SEG = 0xFFFF  # seg id of a slot whose replicas are not exactly one (none, or in ``more``)
HARD_PIN = 1  # flags bit
RUNS = 4  # eviction runs (kvpool.master.eviction)


class ObjectTable:
    """Key -> slot, and per-slot arrays (see the module docstring).

    Mapping-like over keys: ``get(key)`` / ``[key]`` give a view, ``in``, ``len`` (records,
    visible or with only a put in flight), iteration over keys, ``values()`` views;
    :meth:`create` and ``del`` add and drop records.
    """

    def __init__(self):
        self.slots: dict[str, int] = {}
        self.keys: list[str | None] = []
        self.size = array("Q")  # value bytes of the COMPLETE version (= its replicas' length)
        self.seg = array("H")  # segment id of the one COMPLETE replica, or NO_SEG
        self.offset = array("Q")  # its offset
        self.lease = array("d")  # lease deadline, monotonic seconds
        self.soft_pin = array("d")  # soft-pin deadline (0: none)
        self.version = array("Q")  # commit version (protocol.IndexEntry.version)
        self.flags = array("B")
        self.order = array("d")  # the deadline a slot is linked by (reads move ``lease`` only)
        self.prev = array("i")  # eviction-run links (-1: none)
        self.next = array("i")
        self.run = array("b")  # the run a slot is linked in (-1: none)
        self.heads = [-1] * RUNS
        self.tails = [-1] * RUNS
        self.linked = 0
        self.more: dict[int, tuple[Replica, ...]] = {}  # slot -> replicas, when not exactly one
        self.pending: dict[int, PendingPut] = {}
        self.grants: dict[int, Grants] = {}  # slot -> reads of the current version, while open
        self._free_slots: list[int] = []
        self._seg_ids: dict[str, int] = {}
        self.seg_names: list[str | None] = []  # segment id -> name (read-only outside)
        self._free_ids: list[int] = []

    # ------------------------------------------------------------ mapping over keys

    def get(self, key: str) -> "ObjectMeta | None":
        slot = self.slots.get(key)
        return None if slot is None else ObjectMeta(self, slot, key)

    def is_visible(self, slot: int) -> bool:
        return self.seg[slot] != NO_SEG or slot in self.more

    def grants_of(self, slot: int) -> Grants:
        """The read grants of ``slot``'s current version (made on first use)."""
        g = self.grants.get(slot)
        if g is None:
            g = self.grants[slot] = Grants(slot=slot)
        return g

    def __getitem__(self, key: str) -> "ObjectMeta":
        return ObjectMeta(self, self.slots[key], key)

    def __contains__(self, key: str) -> bool:
        return key in self.slots

    def __len__(self) -> int:
        return len(self.slots)

    def __iter__(self) -> Iterator[str]:
        return iter(self.slots)

    def values(self) -> Iterator["ObjectMeta"]:
        return (ObjectMeta(self, s, k) for k, s in list(self.slots.items()))

    def create(self, key: str) -> "ObjectMeta":
        """A new, invisible record for ``key`` (not yet present)."""
        return ObjectMeta(self, self._new_slot(key, NO_SEG, 0, 0, 0.0, 0.0, 0, 0), key)

    def create_complete(self, key: str, replica: Replica, version: int, lease: float, soft_pin: float,
                        hard_pin: bool) -> int:
        """A new record for ``key`` (not yet present) holding ``replica`` as its one
        COMPLETE replica, in one step (the common put: no view, no setter per field).
        Returns its slot, not yet in the eviction order."""
        return self._new_slot(key, self.seg_id(replica.segment), replica.offset, replica.length, lease,
                              soft_pin, version, HARD_PIN if hard_pin else 0)

    def create_complete_run(self, keys: list[str], segment: str, offsets: list[int], sizes: list[int],
                            lease: float, first_version: int) -> list[int]:
        """:meth:`create_complete` of new records for ``keys`` (distinct, none present),
        record i holding ``sizes[i]`` bytes at ``offsets[i]`` of ``segment``, version
        ``first_version + i``, the one ``lease`` deadline, no pin. Slots freed before are
        filled first; the rest are appended with one ``extend`` per array. Returns their
        slots in order, not yet in the eviction order."""
        seg, n = self.seg_id(segment), len(keys)
        reused = min(n, len(self._free_slots))
        slots = [self._new_slot(keys[i], seg, offsets[i], sizes[i], lease, 0.0, first_version + i, 0)
                 for i in range(reused)]
        if reused == n:
            return slots
        base, rest = len(self.keys), n - reused
        self.keys.extend(keys[reused:])
        self.size.extend(sizes[reused:])
        self.seg.extend(array("H", [seg]) * rest)
        self.offset.extend(offsets[reused:])
        self.lease.extend(array("d", [lease]) * rest)
        self.soft_pin.extend(array("d", [0.0]) * rest)
        self.version.extend(range(first_version + reused, first_version + n))
        self.flags.extend(bytes(rest))
        self.order.extend(array("d", [0.0]) * rest)
        self.prev.extend(array("i", [-1]) * rest)
        self.next.extend(array("i", [-1]) * rest)
        self.run.extend(array("b", [-1]) * rest)
        appended = range(base, base + rest)
        self.slots.update(zip(keys[reused:], appended))
        slots.extend(appended)
        return slots

    def _new_slot(self, key: str, seg: int, offset: int, size: int, lease: float, soft_pin: float,
                  version: int, flags: int) -> int:
        # a field added here is added to create_complete_run's appends too
        if self._free_slots:
            slot = self._free_slots.pop()  # its links were reset when it was freed
            self.keys[slot] = key
            self.size[slot], self.seg[slot], self.offset[slot] = size, seg, offset
            self.lease[slot], self.soft_pin[slot], self.order[slot] = lease, soft_pin, 0.0
            self.version[slot], self.flags[slot] = version, flags
        else:
            slot = len(self.keys)
            self.keys.append(key)
            self.size.append(size)
            self.seg.append(seg)
            self.offset.append(offset)
            self.lease.append(lease)
            self.soft_pin.append(soft_pin)
            self.version.append(version)
            self.flags.append(flags)
            self.order.append(0.0)
            self.prev.append(-1)
            self.next.append(-1)
            self.run.append(-1)
        self.slots[key] = slot
        return slot

    def __delitem__(self, key: str) -> None:
        slot = self.slots.pop(key)
        self.unlink(slot)
        self.keys[slot] = None
        self.seg[slot] = NO_SEG
        self.more.pop(slot, None)
        self.pending.pop(slot, None)
        self.grants.pop(slot, None)
        self._free_slots.append(slot)

    # ------------------------------------------------------------ segments

    def seg_id(self, name: str) -> int:
        """The 16-bit id of segment ``name`` (given on first use)."""
        sid = self._seg_ids.get(name)
        if sid is None:
            sid = self._free_ids.pop() if self._free_ids else len(self.seg_names)
            if sid >= NO_SEG:
                raise RuntimeError("more than 65535 segment names in use")
            if sid == len(self.seg_names):
                self.seg_names.append(name)
            else:
                self.seg_names[sid] = name
            self._seg_ids[name] = sid
        return sid

    def on_segment(self, name: str) -> list["ObjectMeta"]:
        """Records with a COMPLETE or PROCESSING replica on segment ``name``: one
        vectorized pass over the segment ids, plus the side tables."""
        import numpy as np  # here, not at the top: the master starts without numpy

        found: set[int] = set()
        sid = self._seg_ids.get(name)
        if sid is not None and len(self.seg):
            view = np.frombuffer(self.seg, dtype=np.uint16)
            found.update(np.flatnonzero(view == sid).tolist())
            del view  # the array can grow again
        found.update(s for s, reps in self.more.items() if any(r.segment == name for r in reps))
        found.update(s for s, p in self.pending.items() if any(r.segment == name for r in p.replicas))
        return [ObjectMeta(self, s, self.keys[s]) for s in sorted(found)]

    def forget_segment(self, name: str) -> None:
        """Release ``name``'s id; no record may still name the segment."""
        sid = self._seg_ids.pop(name, None)
        if sid is not None:
            self.seg_names[sid] = None
            self._free_ids.append(sid)

    # ------------------------------------------------------------ grants

    def drop_grants(self, grants: Grants) -> None:
        """``grants`` has no open read left: forget it if it is still its slot's current
        one (a fresh one is made on the next read)."""
        if self.grants.get(grants.slot) is grants:
            del self.grants[grants.slot]

    # ------------------------------------------------------------ eviction-run links

    def unlink(self, slot: int) -> None:
        """Take ``slot`` out of its eviction run (a no-op when in none)."""
        run = self.run[slot]
        if run < 0:
            return
        p, n = self.prev[slot], self.next[slot]
        if p >= 0:
            self.next[p] = n
        else:
            self.heads[run] = n
        if n >= 0:
            self.prev[n] = p
        else:
            self.tails[run] = p
        self.run[slot], self.prev[slot], self.next[slot] = -1, -1, -1
        self.linked -= 1

    def link_after(self, run: int, slot: int, p: int) -> None:
        """Link ``slot`` into ``run`` right after slot ``p`` (-1: at the head)."""
        n = self.next[p] if p >= 0 else self.heads[run]
        self.run[slot], self.prev[slot], self.next[slot] = run, p, n
        if p >= 0:
            self.next[p] = slot
        else:
            self.heads[run] = slot
        if n >= 0:
            self.prev[n] = slot
        else:
            self.tails[run] = slot
        self.linked += 1


class ObjectMeta:
    """One key's record, as a view of its slot. ``replicas`` are COMPLETE; empty means
    invisible (only a pending put).

    lease_deadline: monotonic second until which a read lease holds (no removal, no
    eviction); also the eviction order (approximate LRU, as in Mooncake).
    soft_pin_deadline: monotonic second until which the soft pin holds (0 = none).
    grants: reads in flight on the current ``replicas``; version: their commit version
    (protocol.IndexEntry.version). ``replicas`` is a new list on every read: assign it to
    change it.
    """

    __slots__ = ("_t", "slot", "key")

    def __init__(self, table: ObjectTable, slot: int, key: str):
        self._t, self.slot, self.key = table, slot, key

    @property
    def size(self) -> int:
        return self._t.size[self.slot]

    @size.setter
    def size(self, value: int) -> None:
        self._t.size[self.slot] = value

    @property
    def replicas(self) -> list[Replica]:
        t, s = self._t, self.slot
        sid = t.seg[s]
        if sid != NO_SEG:
            return [Replica(t.seg_names[sid], t.offset[s], t.size[s])]
        return list(t.more.get(s, ()))

    @replicas.setter
    def replicas(self, replicas: list[Replica]) -> None:
        t, s = self._t, self.slot
        if len(replicas) == 1:
            r = replicas[0]
            t.seg[s], t.offset[s], t.size[s] = t.seg_id(r.segment), r.offset, r.length
            t.more.pop(s, None)
            return
        t.seg[s] = NO_SEG
        if replicas:
            t.more[s] = tuple(replicas)
        else:
            t.more.pop(s, None)
            t.unlink(s)  # invisible: out of the eviction order

    @property
    def visible(self) -> bool:
        return self._t.is_visible(self.slot)

    @property
    def pending(self) -> PendingPut | None:
        return self._t.pending.get(self.slot)

    @pending.setter
    def pending(self, value: PendingPut | None) -> None:
        if value is None:
            self._t.pending.pop(self.slot, None)
        else:
            self._t.pending[self.slot] = value

    @property
    def lease_deadline(self) -> float:
        return self._t.lease[self.slot]

    @lease_deadline.setter
    def lease_deadline(self, value: float) -> None:
        self._t.lease[self.slot] = value

    @property
    def soft_pin_deadline(self) -> float:
        return self._t.soft_pin[self.slot]

    @soft_pin_deadline.setter
    def soft_pin_deadline(self, value: float) -> None:
        self._t.soft_pin[self.slot] = value

    @property
    def hard_pin(self) -> bool:
        return bool(self._t.flags[self.slot] & HARD_PIN)

    @hard_pin.setter
    def hard_pin(self, value: bool) -> None:
        t, s = self._t, self.slot
        if value:
            t.flags[s] |= HARD_PIN
            t.unlink(s)  # never evicted: out of the eviction order
        else:
            t.flags[s] &= ~HARD_PIN

    @property
    def version(self) -> int:
        return self._t.version[self.slot]

    @version.setter
    def version(self, value: int) -> None:
        self._t.version[self.slot] = value

    @property
    def grants(self) -> Grants:
        return self._t.grants_of(self.slot)

    @grants.setter
    def grants(self, value: Grants) -> None:
        if value.open or value.zombie is not None:
            value.slot = self.slot
            self._t.grants[self.slot] = value
        else:  # nothing open: the same as none (one is made on the next read)
            self._t.grants.pop(self.slot, None)

    def leased(self, now: float) -> bool:
        return self._t.lease[self.slot] > now

    def soft_pinned(self, now: float) -> bool:
        return self._t.soft_pin[self.slot] > now
