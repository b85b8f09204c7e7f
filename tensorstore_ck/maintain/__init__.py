"""Keeping a store: retention, gc, fsck, recover, the lifecycle calls (tags, pins, forget,
delete_ref) and what the store's bytes are used for.

    fsck.py           verify every kept snapshot (and `--repair`: damaged blocks to quarantine/)
    gc.py             expire, mark, sweep, safe while writers write; one job over ~600 lines: a gc
                      or prune from its lock to its report
    lease.py          the gc lock held under a lease: gc, prune and fsck --repair take it
    lifecycle.py      tags, pins, forget, delete_ref: fenced against gc, rolled back on failure
    reach.py          which stored objects the kept snapshots reach (gc's mark, fsck's orphans)
    recover.py        rebuild the catalog, refs and tags from storage (a lost ref table)
    retention.py      retention rules and the snapshots they keep
    usage.py          `tsck du` and its plot: the store's bytes per job and over time

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
