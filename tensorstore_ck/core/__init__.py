"""What every layer above is given: the Core of one store (storage, assets, ref table,
pool, settings), typed object I/O, the walk of a snapshot's DAG, the roles layers play
for one another, the arguments checked once.

    locate.py         where a store is: URLs, the marker, its storage and ref table, the
                      options translated into Settings in one place (open_store and the tier)
    core.py           Core: storage, assets, ref table, I/O pool and settings of one store,
                      what the layers below the facade are given
    assets.py         typed, verified object I/O; the only module that knows keys (one
                      job over ~600 lines: every object kind in and out, verified)
    walk.py           the DAG without tensor data (gc, fsck, diff)
    partindex.py      packed parts a Store may name again: content hash -> a stored pack's part
    presence.py       the presence record: objects a Store saw present, per gc epoch
    roles.py          the roles layers play for one another (Protocols): object reader, ref-table parts
    validate.py       snapshot arguments, checked once for every writer

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
