"""The contract suites, for a backend of your own (as zarr ships `zarr.testing.store.StoreTests`).

A block store (your `wrap_storage=` wrapper, an fsspec backend) or a ref table passes the
same tests the project's own backends pass: subclass the suite in a test module and give
it the one fixture it asks for (each module's docstring shows how). Tests that write into
the backend behind the store's back take that from a fixture with a default for the
project's backends (`write_around`; `write_rows`, `read_rows`). Importing this package
imports pytest; `import tensorstore_ck` never does. For pytest's assertion messages inside
the suites, add `pytest.register_assert_rewrite("tensorstore_ck.testing")` to your conftest.py.

    _common.py        threads started together, keys shaped like the store's, TableSuite
    blockstore.py     BlockStoreTests: the BlockStore contract (storage/base.py)
    reftable_rows.py  refs, reflog, steps index, catalog, tags, pins, retention
    reftable.py       RefTableTests: those and removals, gc state, rebuild mark, concurrency, persistence
    tiertable.py      TierTableTests: a local tier's own table (RefTable.tier_rows) over any ref table
"""

from .blockstore import BlockStoreTests
from .reftable import RefTableTests
from .tiertable import TierTableTests

__all__ = ["BlockStoreTests", "RefTableTests", "TierTableTests"]
