"""Radix tree over pages: prefix walk, collision check, locks, per-tier LRU eviction."""

from kvpool.cache.tree import RadixTree


def chain(tree, keys, tier="L1"):
    node, nodes = tree.root, []
    for i, key in enumerate(keys):
        node = tree.add(node, key, b"t" + key, tier, i)
        nodes.append(node)
    return nodes


def test_match_walks_the_longest_prefix():
    tree = RadixTree()
    a, b = chain(tree, [b"a", b"b"])
    nodes, collision = tree.match([b"a", b"b", b"c"], [b"ta", b"tb", b"tc"])
    assert nodes == [a, b] and not collision
    assert tree.match([b"x"], [b"tx"]) == ([], False)


def test_same_key_other_tokens_is_a_collision_not_a_hit():
    tree = RadixTree()
    chain(tree, [b"a", b"b"])
    nodes, collision = tree.match([b"a", b"b"], [b"ta", b"other"])
    assert len(nodes) == 1 and collision


def test_eviction_takes_least_recently_used_leaves_first():
    tree = RadixTree()
    a1, a2 = chain(tree, [b"a1", b"a2"])
    b1, b2 = chain(tree, [b"b1", b"b2"])
    tree.touch(a1)
    tree.touch(a2)  # chain a is now the most recently used
    order = []
    while (victim := tree.pop_lru("L1")) is not None:
        tree.drop(victim, "L1")
        order.append(victim)
    assert order == [b2, b1, a2, a1]
    assert tree.num_nodes == 0


def test_locked_nodes_and_their_prefix_are_never_evicted():
    tree = RadixTree()
    a1, a2 = chain(tree, [b"a1", b"a2"])
    (b1,) = chain(tree, [b"b1"])
    tree.lock(a2)
    assert tree.pop_lru("L1") is b1
    tree.drop(b1, "L1")
    assert tree.pop_lru("L1") is None
    tree.unlock(a2)
    assert tree.pop_lru("L1") is a2


def test_a_node_kept_in_l2_gives_up_l1_without_leaving_the_tree():
    tree = RadixTree()
    a1, a2 = chain(tree, [b"a1", b"a2"])
    tree.set_slot(a1, "L2", 7)
    tree.set_slot(a2, "L2", 8)
    assert tree.pop_lru("L1") is a2
    tree.drop(a2, "L1")
    assert tree.pop_lru("L1") is a1  # its child no longer holds L1
    tree.drop(a1, "L1")
    assert tree.num_nodes == 2 and tree.match([b"a1", b"a2"], [b"ta1", b"ta2"])[0] == [a1, a2]
    assert tree.pop_lru("L2") is a2  # L2 eviction removes leaves only


def test_many_touches_keep_the_heap_bounded():
    tree = RadixTree()
    (a,) = chain(tree, [b"a"])
    for _ in range(10_000):
        tree.touch(a)
    assert len(tree._heaps["L1"]) < 2_000
    assert tree.pop_lru("L1") is a
