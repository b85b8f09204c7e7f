"""The write path: state -> plan -> blocks, nodes, commit -> the ref moved by a fenced
compare-and-swap (docs/design/writing.md).

    saver.py          the saver process: an asynchronous put's blocks written off this
                      process's GIL (open_store(saver="process")), its executor, its loop
    publish.py        the whole write path, one job over ~600 lines: block jobs -> nodes ->
                      commit -> fenced CAS -> retry (the refused commits removed), and
                      the stats of what was written
    executor.py       where block jobs and copies run (threads here; the saver's over
                      saver.py), the jobs written once for both
    packparts.py      packs that keep dedup: a packed tensor a stored pack holds names that
                      part; new packs form from the rest; packs under half named abandoned
    plancache.py      the layouts a Store's puts planned lately: a state of the same layout
                      planned from one, staged in one copy call (thousands of tensors)
    plan.py           state -> plan: every value validated and cut into block jobs before
                      any write; nothing in it writes
    shard.py          Sharded / Replicated: a rank's piece of a global tensor
    staging.py        reused host buffers for async snapshots, within the host-memory bound
    unchanged.py      tensors the kernel proves unchanged since they were hashed: their
                      addresses reused, nothing copied or hashed
    waves.py          a state larger than the bound staged and written in waves

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
