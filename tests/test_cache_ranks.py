"""Multi-rank hit counts: a prefix counts only as far as every TP rank has it."""

import dataclasses
import json
import subprocess
import sys

from kvpool.cache import Namespace
from kvpool.cache.ranks import local_hits
from kvpool.ports import free_port

RANK_SCRIPT = r"""
import dataclasses, json, sys, torch
import torch.distributed as dist
from kvpool.cache import DiskBackend, Namespace, PrefixCache
from kvpool.cache.ranks import min_across_ranks
torch.set_num_threads(1)
rank, port, path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
ns = Namespace(model="tiny", page_size=4, tp_rank=rank, tp_size=2)
shape = (1, 2, 1, 4, 2)
tokens = list(range(24))
disk = DiskBackend(path, max_bytes=1 << 20)
writer = PrefixCache(ns, shape, l1_pages=8, l3=disk, async_backup=False)
writer.insert(tokens, torch.ones((5 - 2 * rank, *shape)))   # rank 0: 5 pages, rank 1: 3
dist.barrier()
reader = PrefixCache(ns, shape, l1_pages=8, l3=disk, reduce_hits=min_across_ranks())
m = reader.match(tokens)
print(json.dumps({"rank": rank, "pages": m.num_pages, "loaded": reader.load(m).shape[0]}))
reader.release(m)
dist.destroy_process_group()
"""



def test_hit_count_is_the_minimum_across_ranks(tmp_path):
    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), port, str(tmp_path)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in (0, 1)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert [(r["pages"], r["loaded"]) for r in results] == [(3, 3), (3, 3)]


def test_single_process_default_keeps_the_count():
    assert local_hits(7) == 7


def test_ranks_are_separate_namespaces():
    ns = Namespace(model="tiny", tp_size=2)
    assert ns.digest() != dataclasses.replace(ns, tp_rank=1).digest()
