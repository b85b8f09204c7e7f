import os

import pytest

# A developer's AWS_*/TSCK_* settings must not leak into the tests.
for _k in list(os.environ):
    if _k.startswith(("AWS_", "TSCK_")):
        del os.environ[_k]

import tensorstore_ck as tsck  # noqa: E402


@pytest.fixture
def store_path(tmp_path):
    return tmp_path / "store"


@pytest.fixture
def store(store_path):
    s = tsck.open_store(store_path)
    yield s
    s.close()
