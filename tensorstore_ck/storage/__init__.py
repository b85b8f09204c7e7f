"""Object storage backends: immutable objects under one root.

Its modules:

    base.py           the BlockStore interface
    local.py          a local filesystem (atomic, durable writes)
    fsspec.py         any fsspec filesystem (memory://, gs://, az://, ...)
    s3.py             S3: its request model and error classes (through s3fs)
    aimd.py           the S3 client's send rate under throttling (AIMD; cuts that do not help pause)
    wrappers.py       read-only, retrying, throttled and fault-injecting wrappers
"""

from .base import BlockStore, ObjectInfo
from .fsspec import FsspecBlockStore
from .local import LocalBlockStore
from .s3 import S3BlockStore

__all__ = ["BlockStore", "ObjectInfo", "LocalBlockStore", "FsspecBlockStore", "S3BlockStore"]
