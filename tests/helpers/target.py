"""Open the store a test handed to a helper subprocess.

The argument is either a plain local path or a JSON object
{"url": ..., "refs": ..., "storage_options": ...} written by
tests/_backends.py `Backend.spec()`, so one helper script serves every backend
(file://, s3:// on a real server, the PostgreSQL ref table).
"""

from __future__ import annotations

import json

import tensorstore_ck as tsck


def open_target(arg, **kw):
    arg = str(arg)
    if arg.startswith("{"):
        spec = json.loads(arg)
        return tsck.open_store(spec["url"], refs=spec.get("refs"),
                               storage_options=spec.get("storage_options"), **kw)
    return tsck.open_store(arg, **kw)
