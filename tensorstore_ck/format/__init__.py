"""Bytes <-> objects for everything stored. No I/O happens in this package.

Its modules:

    frame.py          the object frame: header, then the (maybe compressed) payload
    manifest.py       manifest node and commit envelopes
    tree.py           the manifest grammar: every value a node holds
    world.py          the top of a multi-rank snapshot: rank tree and chunk index
    dcp.py            the top of a dcp.save snapshot: recognized, its planner_data read
    dtypes.py         stored dtype names <-> torch and numpy dtypes
    names.py          ref/tag names and target strings
    records.py        ref-table records and stored tag objects
    chunker.py        tensor bytes -> element-aligned blocks
"""
