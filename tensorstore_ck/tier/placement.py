"""Where the copies of each rank's part go (docs/design/memtier.md, "Placement"): k
holders per rank, on k distinct nodes other than its own, so that losing one node (all
its ranks at once) never loses a part's only copy, and the copies spread so that each
node holds about as many parts as any other.

    holders(nodes, k)    nodes: one node name per rank -> for each rank, its k holders
    read_from(put, now, rank, k)   the ranks of a restarted job to ask for a snapshot's parts
    this_node()          this process's node name ($TSCK_NODE, else the host's name)

A pure function of its arguments: every rank computes the same answer from the same
list (the ranks' node names, gathered once), with no message about it.

How: the ranks of one node are alike to the rule (each may use any other node), so the
rule first settles how many parts of node u's ranks node v holds (x[u][v], at most one
per rank of u: a rank's k holders are on distinct nodes), as a flow from the nodes'
parts to the nodes' room: room q = floor(kW/m) per node first, then one more, then
more only if nothing balanced fits (a node with most of the ranks leaves the others
more than their share): the most any node holds is the least it can be, and within one
of the least when that is possible at all. Then each node's parts are dealt to its
ranks in turn (node u's ranks take x[u][v] copies for v in node order, rank by rank, so
no rank gets v twice), and each node's copies to its ranks, least-loaded first.
"""

from __future__ import annotations

from collections import deque

from ..errors import InvalidArgument

__all__ = ["holders", "next_ranks", "read_from", "this_node"]


def this_node() -> str:
    """This process's node name, for the list holders() is given: $TSCK_NODE (nodes
    simulated on one machine), else the host's name."""
    import os
    import socket
    return os.environ.get("TSCK_NODE") or socket.gethostname()


def holders(nodes, k: int) -> list[list[int]]:
    """For each rank r (nodes[r] its node's name), the k ranks holding copies of its part:
    on k distinct nodes, none of them nodes[r]. InvalidArgument when fewer than k other
    nodes exist (or k < 0)."""
    nodes = [str(n) for n in nodes]
    if k < 0:
        raise InvalidArgument(f"a part's copies on peers: k must be 0 or more, not {k}")
    names = sorted(set(nodes))
    m = len(names)
    if k and k > m - 1:
        raise InvalidArgument(f"{k} copies of each rank's part on other nodes need {k + 1} nodes; the job's "
                              f"{len(nodes)} rank(s) are on {m} ({', '.join(names[:8])}"
                              f"{', ...' if m > 8 else ''})")
    if not k:
        return [[] for _ in nodes]
    index = {n: i for i, n in enumerate(names)}
    ranks = [[] for _ in names]  # node -> its ranks, in rank order
    for r, n in enumerate(nodes):
        ranks[index[n]].append(r)
    x = _node_counts([len(rs) for rs in ranks], k)
    held = [0] * len(nodes)  # copies each rank holds so far
    out: list[list[int]] = [[] for _ in nodes]
    for u, rs in enumerate(ranks):
        seq = [v for v in range(m) for _ in range(x[u][v])]  # each v at most len(rs) times in a row
        for slot, v in enumerate(seq):
            r = rs[slot % len(rs)]
            h = min(ranks[v], key=lambda c: (held[c], c))
            held[h] += 1
            out[r].append(h)
    return out


def next_ranks(world: int, k: int) -> list[list[int]]:
    """For each of `world` ranks, the next k (mod world): where copies go when the job has
    fewer than k+1 nodes (copies a lost node takes with it)."""
    return [[(r + i) % world for i in range(1, min(k, world - 1) + 1)] for r in range(world)]


def read_from(put, now, rank: int, k: int) -> list[int]:
    """The ranks of the job now (rank r on node now[r]) that hold the parts rank `rank` reads
    of a snapshot put by ranks on nodes `put` with k copies of each part, in the order to
    ask them; never `rank` itself (its own tier is read first anyway).

    A tier is its node's i-th rank's, not a rank number's: memory=True names it by node and
    local rank, because a restarted job may number its nodes otherwise (torchrun's
    rendezvous orders them anew; an elastic restart has fewer or more), and the node's
    i-th rank opens the same tier again. So the tier of rank h at the put is the one of the
    rank now that is the i-th of h's node, i the place of h among its node's ranks; none
    when that node is gone or has fewer ranks now.

    Which parts: the rank's own (its private state, at any world size), the parts whose
    share of a split over len(put) ranks overlaps this rank's share of a split over
    len(now) ranks, and their neighbours (a row split resharded), then part 0 (a rank
    beyond the saved world reads rank 0's tree). Each part from its own tier first, then
    its holders. Parts read other than these (another layout's) come from the remote."""
    put, now = [str(n) for n in put], [str(n) for n in now]
    w, v = len(put), len(now)
    if not w or not v:
        return []
    place = holders(put, k) if k and len(set(put)) > k else next_ranks(w, k)  # (Peers.holders' rule)
    at_now = {slot: r for r, slot in enumerate(_slots(now))}
    was = _slots(put)
    lo, hi = rank * w // v, -(-(rank + 1) * w // v)  # parts [lo, hi) overlap this rank's share
    parts = ([rank] if rank < w else []) + list(range(lo, min(hi, w))) + [lo - 1, hi, 0]
    out: list[int] = []
    for j in dict.fromkeys(p for p in parts if 0 <= p < w):
        for h in (j, *place[j]):
            r = at_now.get(was[h])
            if r is not None and r != rank and r not in out:
                out.append(r)
    return out


def _slots(nodes: list[str]) -> list[tuple[str, int]]:
    """Each rank's (node, its place among that node's ranks, in rank order)."""
    seen: dict[str, int] = {}
    out = []
    for n in nodes:
        out.append((n, seen.get(n, 0)))
        seen[n] = out[-1][1] + 1
    return out


def _node_counts(sizes: list[int], k: int) -> list[list[int]]:
    """x[u][v]: how many parts of node u's ranks node v holds (u != v, at most sizes[u]),
    each row summing to k * sizes[u], the columns' largest sum the least possible."""
    m = len(sizes)
    total = k * sum(sizes)
    src, snk = m * 2, m * 2 + 1
    g = _Flow(m * 2 + 2)
    for u in range(m):
        g.add(src, u, k * sizes[u])
        for v in range(m):
            if v != u:
                g.add(u, m + v, sizes[u])
    room = [g.add(m + v, snk, 0) for v in range(m)]
    flow, cap = 0, total // m
    while flow < total:
        for e in room:
            g.cap[e] += cap - g.limit[e]  # (room raised: what flows already stays)
            g.limit[e] = cap
        flow += g.maxflow(src, snk)
        cap += 1
    x = [[0] * m for _ in range(m)]
    for u in range(m):
        for e in g.adj[u]:
            v = g.to[e] - m
            if 0 <= v < m and e % 2 == 0:
                x[u][v] = g.limit[e] - g.cap[e]
    return x


class _Flow:
    """A small max-flow (Dinic) over integer capacities; edges in pairs (e, e ^ 1)."""

    def __init__(self, n: int):
        self.adj = [[] for _ in range(n)]
        self.to, self.cap, self.limit = [], [], []

    def add(self, a: int, b: int, c: int) -> int:
        e = len(self.to)
        self.to += [b, a]
        self.cap += [c, 0]
        self.limit += [c, 0]
        self.adj[a].append(e)
        self.adj[b].append(e + 1)
        return e

    def maxflow(self, s: int, t: int) -> int:
        total = 0
        while True:
            level = [-1] * len(self.adj)
            level[s] = 0
            q = deque([s])
            while q:
                a = q.popleft()
                for e in self.adj[a]:
                    if self.cap[e] > 0 and level[self.to[e]] < 0:
                        level[self.to[e]] = level[a] + 1
                        q.append(self.to[e])
            if level[t] < 0:
                return total
            it = [0] * len(self.adj)
            while True:
                f = self._push(s, t, 1 << 62, level, it)
                if not f:
                    break
                total += f

    def _push(self, a: int, t: int, f: int, level: list, it: list) -> int:
        if a == t:
            return f
        while it[a] < len(self.adj[a]):
            e = self.adj[a][it[a]]
            b = self.to[e]
            if self.cap[e] > 0 and level[b] == level[a] + 1:
                got = self._push(b, t, min(f, self.cap[e]), level, it)
                if got:
                    self.cap[e] -= got
                    self.cap[e ^ 1] += got
                    return got
            it[a] += 1
        return 0
