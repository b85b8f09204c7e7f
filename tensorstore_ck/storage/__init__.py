"""Object storage backends: immutable objects under one root."""

from .base import BlockStore, ObjectInfo
from .fsspec import FsspecBlockStore
from .local import LocalBlockStore
from .s3 import S3BlockStore

__all__ = ["BlockStore", "ObjectInfo", "LocalBlockStore", "FsspecBlockStore", "S3BlockStore"]
