"""A local tier in front of a remote store (docs/design/tiers.md): open_store(remote,
local=PATH) publishes on a local disk and a background uploader makes each snapshot
durable in the remote store. The Store holds one LocalTier (without a tier, a NoTier) and
calls nothing else here.

    local.py        LocalTier: what a Store over a tier holds, its few meeting points
    none.py         NoTier: what a Store without one holds in its place (the same calls, its own store)
    opening.py      the tier's Core made (and the remote opened on first use)
    peerreads.py    a checkout's reads from the peers holding its replicas (batched, by placement)
    replicas.py     peer replicas over a TCP side channel: placed by node, sent, served,
                    fetched back (one job over ~650 lines: a rank's part on its peers)
    uploader.py     the queue and its thread: objects the remote lacks, then its ref moved
                    (one job over ~600 lines: a queued snapshot until it is durable)
    collective.py   a collective put through tiers: each rank's part, rank 0's move
    holds.py        one catalog: the tier's tags and pins made in the remote table
    budget.py       the tier's bytes, and durable copies evicted to fit
    outage.py       outages: which upload failures are waited out, how far the remote lags
    reads.py        reads through the tier with the remote behind; which tier is newer
    placement.py    which ranks of other nodes hold the copies of each rank's part
    stream.py       blocks streamed between peers, many in flight, each checked on arrival
    memory.py       the memory tier's place (a tmpfs) and the schedule of durable snapshots
    keeper.py       the copies a restore fetched from peers, kept in the tier in the background

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
