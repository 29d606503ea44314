"""HA masters over etcd: leader election, failover by kill -9, the fence of a paused leader.

Real processes: an etcd server (Debian's etcd-server) on loopback with a temporary data
directory and free ports, two ``kvpool master --etcd`` (one leads, one stands by) and
nodes given both masters' addresses. Clients are given the list (or ``etcd://``) and
follow the leader without being restarted.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import threading
import time

import proc_helpers
import pytest

from kvpool import protocol as P
from kvpool.child import pause_process
from kvpool.client import Client
from kvpool.errors import ErrorCode, KVPoolError, ObjectExists
from kvpool.etcd import Etcd
from kvpool.launch_ha import EtcdServer, HAGroup, etcd_binary, is_leader
from kvpool.master.election import Election
from kvpool.rpc import MIN_WAIT, RpcChannel

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd not installed (apt-get install etcd-server)")
TTL_S = 2  # etcd's smallest lease TTL with its default election timeout
FAST = ["--client-ttl", "4"]  # heartbeats every second: a stalled stream is noticed soon


def value_of(key: str, size: int = 8192) -> bytes:
    """A value that names its key: a hash stream seeded by the key."""
    seed = hashlib.sha256(key.encode()).digest()
    return (seed * (size // len(seed) + 1))[:size]


def put_ok(client: Client, key: str) -> bool:
    """One put of ``key``; True when it is stored (also by an earlier try whose reply
    was lost in the failover), False on a retryable failure."""
    try:
        client.put(key, value_of(key))
    except ObjectExists:
        pass
    except KVPoolError:
        return False
    return True


def readable(client: Client, key: str) -> bool:
    try:
        return client.get(key) == value_of(key)
    except KVPoolError:
        return False


@contextlib.contextmanager
def leader_stopped(group: HAGroup, old: int):
    """SIGSTOP master ``old`` (the leader: its connections stay open, nothing answers);
    the block runs once the standby has taken over; SIGCONT when it ends."""
    pid = group.masters[old].proc.pid
    assert pause_process(pid)
    try:
        proc_helpers.wait_for(lambda: group.leader_index() not in (None, old), 30, "the standby to take over")
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def test_election_fences_on_its_own_clock():
    """A leader refuses the moment its monotonic deadline passes, with no word from etcd;
    while it holds the key, another candidate cannot lead."""
    etcd = EtcdServer()
    try:
        now = [100.0]
        a = Election(Etcd(etcd.url), "127.0.0.1:1", TTL_S, key="t/leader", clock=lambda: now[0])
        b = Election(Etcd(etcd.url), "127.0.0.1:2", TTL_S, key="t/leader", clock=lambda: now[0])
        assert a.campaign() and a.refusal() is None
        assert not b.campaign()
        assert "standby" in b.refusal() and "127.0.0.1:1" in b.refusal()
        now[0] += a.ttl_s * 0.9 + 0.001  # past SAFETY * ttl: fenced before etcd expires the lease
        assert not a.leading() and "lost the lead" in a.refusal()
        # etcd still holds the lease, but a renewal never restores the right to grant:
        # requests refused meanwhile may have changed this master's memory (found in a
        # trial: a revived leader acknowledged commits no node knew, lost at the next failover)
        assert not a.renew() and not a.leading() and a.fenced
        etcd.client.revoke(a.lease_id)
        assert b.campaign() and b.refusal() is None
    finally:
        etcd.stop()


def test_failover_by_kill_keeps_committed_objects():
    """kill -9 the leader with a standby running: the standby leads, the nodes mount with
    it once each and it rebuilds from their indexes; every object committed before the
    kill is read with its bytes; the killed master comes back as a standby and a second
    failover (back to it) keeps everything too."""
    with HAGroup(masters=2, num_nodes=2, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=10.0) as c, \
                Client(f"etcd://{group.etcd.url.split('//')[1]}", timeout_s=10.0) as via_etcd:
            keys = [f"ha/{i}" for i in range(20)]
            for i, key in enumerate(keys):
                assert c.put(key, value_of(key), replica_num=2 if i % 2 else 1) >= 1
            for round_ in range(2):
                old = group.wait_leader()
                killed_at = time.monotonic()
                group.masters[old].stop(kill=True)
                proc_helpers.wait_for(lambda: put_ok(c, f"ha/after-{round_}"), 30, "the new leader to serve puts")
                serving_s = time.monotonic() - killed_at
                proc_helpers.wait_for(lambda: all(readable(c, k) for k in keys), 30,
                                      "the objects committed before the failover")
                restored_s = time.monotonic() - killed_at
                new = group.wait_leader()
                assert new != old
                assert all(readable(via_etcd, k) for k in keys)  # etcd names the new leader
                after = [f"ha/after-{r}" for r in range(round_ + 1)]
                stats = c.stats()
                count = stats.object_count
                # each node mounted once: a heartbeat that reached the new leader before
                # the node's mount no longer cuts that mount (a second mount, a resync)
                assert (stats.counters.get("segments_mounted"), stats.counters.get("index_resyncs", 0)) == (2, 0)
                # which one is gone, and what the new leader's log says of the mounts
                assert count == len(keys) + round_ + 1 and all(readable(c, k) for k in after), (
                    count, [k for k in after if not readable(c, k)], group.masters[new].log_tail(40))
                print(f"failover {round_}: serving after {serving_s:.2f} s, objects readable after "
                      f"{restored_s:.2f} s (lease {TTL_S} s)")
                group.start_master(old)  # back as a standby, on its own port
                assert not is_leader(group.master_addrs[old])


def test_puts_acknowledged_through_two_failovers_are_all_kept():
    """A writer puts without pause (one and two replicas, through the allocation lease
    and the PutStart way) while the leader is killed twice: every put that returned is
    read back with its bytes afterwards, whichever master it went to. A put that failed
    or found its key existing (a try whose reply was lost) promised nothing: if its
    key reads at all, it reads its own bytes (never another key's)."""
    acked: list[str] = []
    unsure: list[str] = []
    stop = threading.Event()

    def writer(c: Client) -> None:
        i = 0
        while not stop.is_set():
            key = f"w/{i}"
            try:
                c.put(key, value_of(key, 4096), replica_num=1 + (i % 3 == 0))
                acked.append(key)
            except KVPoolError:  # ObjectExists among them
                unsure.append(key)
            i += 1

    def read(c: Client, key: str) -> bytes | None:
        try:
            return c.get(key)
        except KVPoolError:
            return None

    with HAGroup(masters=2, num_nodes=2, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=10.0) as c:
            thread = threading.Thread(target=writer, args=(c,))
            thread.start()
            try:
                for _ in range(2):
                    proc_helpers.wait_for(lambda: len(acked) >= 50, 30, "puts to the leader")
                    acked_before = len(acked)
                    old = group.wait_leader()
                    group.masters[old].stop(kill=True)
                    proc_helpers.wait_for(lambda: len(acked) >= acked_before + 50, 30, "puts to the new leader")
                    group.start_master(old)  # a standby again, for the second failover
                    acked_now = len(acked)
                    proc_helpers.wait_for(lambda: len(acked) >= acked_now + 50, 30, "more puts")
            finally:
                stop.set()
                thread.join()
            missing = [k for k in acked if read(c, k) != value_of(k, 4096)]
            assert not missing, (len(missing), len(acked), missing[:10], group.masters[group.leader_index()].log_tail(40))
            for key in unsure:
                assert read(c, key) in (None, value_of(key, 4096))
            print(f"{len(acked)} puts acknowledged, {len(unsure)} failed or unsure: all kept")


def test_paused_leader_refuses_when_resumed():
    """SIGSTOP the leader until the standby has taken over; requests waiting in its
    socket when it resumes are refused (no grant of a read or a write), and it stops."""
    with HAGroup(masters=2, num_nodes=1, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=5.0) as c:
            c.put("kept", value_of("kept"))
            old = group.wait_leader()
            stale = RpcChannel(group.master_addrs[old], 5.0, b"")
            stale.call(P.Ping())
            with leader_stopped(group, old):
                # the node finds its stream stalled (heartbeats time out) and mounts with the new leader
                proc_helpers.wait_for(lambda: readable(c, "kept"), 60, "the object on the new leader")
                assert put_ok(c, "after")
                stale._sock.sendall(P.encode_frame(P.GetReplicaList("kept")) + P.encode_frame(
                    P.PutStart(P.PutItem("stale", 4096, 1))))
            replies = []
            for _ in range(2):
                try:
                    replies.append(P.reply_decoder.decode(P.recv_frame(stale._sock)))
                except (OSError, P.FrameError):
                    break  # it closed the connection on its way out: no grant either
            stale.close()
            for reply in replies:
                assert isinstance(reply, P.ErrorResp), reply
                assert reply.code == ErrorCode.UNAVAILABLE_IN_CURRENT_STATUS
            group.masters[old].stopped = True  # exit status 3 is what is expected here
            assert group.masters[old].proc.wait(20) == 3
            assert c.get("kept") == value_of("kept") and c.get("after") == value_of("after")
            assert not c.is_exist("stale")


def test_a_stalled_leader_loses_the_nodes_once_another_master_leads():
    """With the leader stopped (SIGSTOP: its connections stay open, nothing answers), a
    node's heartbeat gives up after about one interval instead of the channel's whole
    timeout (5 s), and ends its index stream once another master answers as leader, so
    the new leader gets the segment and its objects. A segment host's check of that
    (_leader_elsewhere) says no while the leader runs (the standby refuses)."""
    with HAGroup(masters=2, num_nodes=1, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=5.0) as c, \
                Client(group.master_spec, timeout_s=5.0, global_segment_size=1 << 20) as own:
            c.put("kept", value_of("kept"))
            old = group.wait_leader()
            assert not own.segment._leader_elsewhere()
            with leader_stopped(group, old):
                led_at = time.monotonic()
                new = RpcChannel(group.master_addrs[group.leader_index()], 5.0, b"")
                proc_helpers.wait_for(lambda: new.call(P.GetReplicaList("kept")).code == ErrorCode.OK, 30,
                                      "the node to mount with the new leader")
                print(f"the node's object found on the new leader {time.monotonic() - led_at:.2f} s "
                      "after it took over")
                new.close()
                # the heartbeat's check ended the stream, or the new leader's answer to the
                # next heartbeat did; before, the heartbeat waited out its 5 s timeout
                # ("no leader took the heartbeat")
                # ("kept" may sit in `own`'s segment: the node is waited for on its own)
                gave_up = f"no answer within {max(1.0, MIN_WAIT * 5.0):g} s"  # 1 s interval, >= MIN_WAIT of 5 s
                proc_helpers.wait_for(lambda: gave_up in group.nodes[0].log_tail(200) and any(
                    why in group.nodes[0].log_tail(200) for why in ("another master leads", "master forgot segment")),
                    30, "the node's heartbeat to give up after one interval and its stream to end")
            group.masters[old].stopped = True  # it exits (status 3) on finding it lost the lead


def test_a_client_follows_a_stalled_leader_without_waiting_out_its_timeout():
    """With the leader stopped (SIGSTOP: its connections stay open, nothing answers), a
    client's next requests go to the new leader about STALL_PROBE_S after it took over,
    not after the client's timeout (60 s here; before, each waited it out): a query
    (idempotent), a bare PutStart (not idempotent: the stopped leader, fenced, refuses
    it when it runs again) and a whole put of a client whose connection and allocation
    lease were the stopped leader's. The put's value is stored once, and readable."""
    quick = 15.0  # s: far below the 60 s timeout, far above the ~1 s a probe takes
    with HAGroup(masters=2, num_nodes=1, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=60.0) as c, Client(group.master_spec, timeout_s=60.0) as late:
            c.put("kept", value_of("kept"))
            late.put("before", value_of("before"))  # its connection and lease: the leader's
            old = group.wait_leader()
            with leader_stopped(group, old):
                started = time.monotonic()
                c.stats()  # asked of the stopped leader first (this thread's connection)
                print(f"a query answered {time.monotonic() - started:.2f} s after the new leader took over")
                assert time.monotonic() - started < quick, "the client waited out its timeout"
                proc_helpers.wait_for(lambda: readable(c, "kept"), 30, "the node to mount with the new leader")
                stopped_first = [group.master_addrs[old]] + [a for a in group.master_addrs if a != group.master_addrs[old]]
                put = RpcChannel(",".join(stopped_first), 60.0, b"")
                put.connect()  # to the first of the list: the stopped leader
                assert put.addr == group.master_addrs[old]
                started = time.monotonic()
                reply = put.call(P.PutStart(P.PutItem("fresh", 4096, 1)), idempotent=False)
                assert reply.code == ErrorCode.OK and put.addr == group.master_addrs[group.leader_index()]
                assert time.monotonic() - started < quick, "the PutStart waited out its timeout"
                put.close()
                started = time.monotonic()
                assert late.put("during", value_of("during")) == 1
                assert time.monotonic() - started < quick, "the put waited out its timeout"
            group.masters[old].stopped = True  # it exits (status 3) on finding it lost the lead
            assert group.masters[old].proc.wait(20) == 3
            for key in ("kept", "before", "during"):
                assert c.get(key) == value_of(key)
            with pytest.raises(ObjectExists):
                late.put("during", value_of("during"))


def test_an_ha_group_with_a_shared_secret_elects_and_serves_only_clients_that_know_it(monkeypatch):
    """HAGroup under KVPOOL_SECRET: its masters and nodes take the secret, its leader
    checks answer the challenge (before, they asked without it and never found a
    leader); a client with the secret puts and gets, one without is refused."""
    from kvpool.errors import RpcFailed

    monkeypatch.setenv("KVPOOL_SECRET", "ha-secret")
    with HAGroup(masters=2, num_nodes=1, lease_ttl_s=TTL_S, master_args=FAST) as group:
        with Client(group.master_spec, timeout_s=10.0) as c:
            assert c.put("s/1", b"v" * 100) == 1 and c.get("s/1") == b"v" * 100
        monkeypatch.delenv("KVPOOL_SECRET")
        with pytest.raises(RpcFailed):
            with Client(group.master_spec, timeout_s=2.0) as stranger:
                stranger.get("s/1")


def test_master_on_a_wildcard_address_must_advertise():
    out = proc_helpers.run_kvpool("master", "--etcd", "127.0.0.1:1", "--host", "0.0.0.0", "--port", "0")
    assert out.returncode != 0
    assert "--advertise" in out.stderr and "Traceback" not in out.stderr
