"""The placement rule of peer copies (tier/placement.py): for each rank, k holders on k
distinct nodes, none its own; the nodes' loads within 1 of each other whenever any
placement can do that (always when the nodes have the same number of ranks), and the
largest load the least possible otherwise; the same answer from the same list; a clear
error when fewer than k other nodes exist. Fast: a pure function. And where a restarted
job finds a snapshot's parts (read_from): the tiers of the node's i-th rank, whatever the
ranks' numbers now, the nodes lost, added or reordered."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tensorstore_ck.errors import InvalidArgument
from tensorstore_ck.tier.placement import holders, read_from, this_node


def _node_loads(nodes, placed):
    load = Counter({n: 0 for n in nodes})
    for hs in placed:
        for h in hs:
            load[nodes[h]] += 1
    return load


def _check_rules(nodes, k, placed):
    assert len(placed) == len(nodes)
    for r, hs in enumerate(placed):
        assert len(hs) == k
        assert all(0 <= h < len(nodes) for h in hs)
        assert nodes[r] not in {nodes[h] for h in hs}, f"rank {r} has a holder on its own node"
        assert len({nodes[h] for h in hs}) == k, f"rank {r}'s holders share a node"


@st.composite
def _layout(draw, equal: bool):
    m = draw(st.integers(1, 7))
    if equal:
        per = draw(st.integers(1, 5))
        sizes = [per] * m
    else:
        sizes = draw(st.lists(st.integers(1, 5), min_size=m, max_size=m))
    names = draw(st.lists(st.text("abcxyz0123-.", min_size=1, max_size=6), min_size=m, max_size=m, unique=True))
    nodes = [n for n, s in zip(names, sizes) for _ in range(s)]
    order = draw(st.permutations(range(len(nodes))))  # ranks of a node need not be neighbours
    k = draw(st.integers(0, 4))
    return [nodes[i] for i in order], k


@settings(max_examples=300, deadline=None)
@given(_layout(equal=True))
def test_equal_nodes_copies_off_node_on_distinct_nodes_balanced_within_one(case):
    nodes, k = case
    m = len(set(nodes))
    if k > m - 1:
        with pytest.raises(InvalidArgument, match="nodes"):
            holders(nodes, k)
        return
    placed = holders(nodes, k)
    _check_rules(nodes, k, placed)
    load = _node_loads(nodes, placed)
    assert max(load.values()) - min(load.values()) <= 1, load
    per_rank = Counter(h for hs in placed for h in hs)
    held = [per_rank.get(r, 0) for r in range(len(nodes))]
    assert max(held) - min(held) <= 1, held  # ranks too, nodes being alike
    assert holders(list(nodes), k) == placed  # the same on every rank


def _best_possible(nodes, k):
    """(the least largest node load, the least spread max - min) over every placement,
    by trying every choice of holder nodes (small cases only)."""
    names = sorted(set(nodes))
    options = [[c for c in itertools.combinations(names, k) if nodes[r] not in c] for r in range(len(nodes))]
    top = spread = None
    for pick in itertools.product(*options):
        load = Counter(n for c in pick for n in c)
        loads = [load.get(n, 0) for n in names]
        top = max(loads) if top is None else min(top, max(loads))
        spread = max(loads) - min(loads) if spread is None else min(spread, max(loads) - min(loads))
    return top, spread


@settings(max_examples=150, deadline=None)
@given(_layout(equal=False))
def test_any_nodes_copies_off_node_balanced_within_one_when_possible_the_top_load_least(case):
    nodes, k = case
    m = len(set(nodes))
    if k > m - 1:
        with pytest.raises(InvalidArgument):
            holders(nodes, k)
        return
    placed = holders(nodes, k)
    _check_rules(nodes, k, placed)
    load = _node_loads(nodes, placed)
    assert holders(nodes, k) == placed
    if k and len(nodes) <= 5:
        top, spread = _best_possible(nodes, k)
        assert max(load.values()) == top, (nodes, k, load)
        if spread <= 1:
            assert max(load.values()) - min(load.values()) <= 1, (nodes, k, load)


def test_fewer_other_nodes_than_copies_is_a_clear_error():
    with pytest.raises(InvalidArgument, match=r"2 copies .* need 3 nodes.* 4 rank\(s\) are on 2"):
        holders(["a", "a", "b", "b"], 2)
    with pytest.raises(InvalidArgument):
        holders(["a"], -1)
    assert holders(["a"], 0) == [[]]


def test_a_thousand_ranks_are_placed_at_once():
    nodes = [f"node{r // 8:03d}" for r in range(1024)]
    placed = holders(nodes, 2)
    _check_rules(nodes, 2, placed)
    load = _node_loads(nodes, placed)
    assert set(load.values()) == {16}


def test_this_node_is_tsck_node_else_the_hosts_name(monkeypatch):
    import socket
    monkeypatch.setenv("TSCK_NODE", "sim-node-3")
    assert this_node() == "sim-node-3"
    monkeypatch.delenv("TSCK_NODE")
    assert this_node() == socket.gethostname()


def _tier_of(nodes):
    """rank -> (node, its place among the node's ranks): the tier a rank opens
    (memory=True's directory, by node and local rank)."""
    seen: Counter = Counter()
    out = []
    for n in nodes:
        out.append((n, seen[n]))
        seen[n] += 1
    return out


def test_a_restart_on_the_same_nodes_asks_its_parts_holders_first():
    put = ["a", "a", "b", "b", "c", "c"]
    for k in (1, 2):
        for r in range(len(put)):
            assert read_from(put, put, r, k)[:k] == holders(put, k)[r], (k, r)
            assert r not in read_from(put, put, r, k)


def test_renumbered_fewer_and_more_nodes_find_each_part_where_its_tiers_are_now():
    put = ["a", "a", "b", "b"]  # holders(put, 1) == [[2], [3], [0], [1]]
    # torchrun numbered the nodes the other way round: part 0's tier is rank 2's now, and
    # its copy (on b's first rank then) is rank 0's own tier
    assert read_from(put, ["b", "b", "a", "a"], 2, 1)[0] == 0
    assert read_from(put, ["b", "b", "a", "a"], 0, 1)[0] == 2
    # node b lost, no machine in its place: 4 ranks on a and c read 6 parts; rank 3 (c's
    # second) reads rows of parts 4 and 5: part 4 is in rank 2's tier (c's first)
    six = ["a", "a", "b", "b", "c", "c"]
    assert 2 in read_from(six, ["a", "a", "c", "c"], 3, 1)
    # a node added: rank 4 (on d, an empty tier) reads rows of parts 2 and 3, on b
    got = read_from(put, ["a", "a", "b", "b", "d", "d"], 4, 1)
    # (part 2's tier, its copy, part 3's; part 0: a rank past the saved world reads rank 0's tree)
    assert got[0] == 2 and {0, 3} <= set(got)


@st.composite
def _restart(draw):
    names = ["a", "b", "c", "d", "e"]
    m = draw(st.integers(2, 4))
    per = draw(st.integers(1, 3))
    put = [n for n in names[:m] for _ in range(per)]
    k = draw(st.integers(1, m - 1))
    kept = draw(st.lists(st.sampled_from(names), min_size=1, max_size=4, unique=True))
    per_now = draw(st.integers(1, 3))
    now = [n for n in kept for _ in range(per_now)]
    return put, draw(st.permutations(now)), k


@settings(max_examples=300, deadline=None)
@given(_restart())
def test_every_part_a_rank_reads_is_asked_of_a_tier_that_still_holds_it(case):
    """Nodes lost, added, reordered, more or fewer ranks a node: for each rank now and each
    part whose rows it reads (a row split resharded) or whose private state it reads, some
    surviving tier of that part (its own, or a holder's) is asked, or is the rank's own."""
    put, now, k = case
    w, v = len(put), len(now)
    was, tier = _tier_of(put), _tier_of(now)
    place = holders(put, k)
    for r in range(v):
        asked = read_from(put, now, r, k)
        assert r not in asked and len(asked) == len(set(asked))
        reach = {tier[q] for q in asked} | {tier[r]}
        lo, hi = r * w // v, -(-(r + 1) * w // v)
        for j in {*range(lo, hi), r if r < w else 0}:
            alive = {was[h] for h in (j, *place[j])} & set(tier)
            assert not alive or alive & reach, (put, now, k, r, j)
