"""The read path: nodes -> tensors, every block verified (docs/design/reading.md). Every
checkout enters through readpath.read_state.

    readpath.py       the read path's front door: every checkout enters through read_state
    dcpstate.py       a dcp.save snapshot read by checkout as the state that was saved
    read.py           nodes -> state: the Reader of one snapshot (one job, ~600 lines)
    listing.py        `tsck ls`, `tsck diff`, `tsck log/refs`: snapshots described from their
                      nodes and catalog rows (no blocks, no torch)
    read_world.py     sharded tensors and multi-rank snapshots read (read_box: a chunk's
                      region; a rank's view merged from the rank trees and chunk index)
    placement.py      map_location: where a checkout's fresh tensors go, unknown devices refused
    prefetch.py       Store.prefetch: a ref's newest snapshot on a local disk read into the page
                      cache in the background, before a restarting job restores it
    readjobs.py       block reads run in parallel; a pack read once for all its parts wanted
    world_view.py     one process's view of a collective snapshot: the ranks' trees merged

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
