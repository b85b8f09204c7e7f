"""The Lightning pointer file without Lightning (tensorstore_ck.ckpt_pointer): any store URL
gives a file of five lines whose JSON reads back as written, and torch.load of it stops
at the preamble with the message, never runs past it. Stored bytes are never unpickled."""
from __future__ import annotations

import io
import pickle

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.ckpt_pointer import parse_pointer, pointer_bytes

ROOT = "ab" * 32


@pytest.mark.parametrize("store, shown", [
    ("file:///srv/ckpts", "file:///srv/ckpts"),
    ("/srv/my runs/ckpts", "'/srv/my runs/ckpts'"),
    ("/srv/a\nb", "STORE"),
    ("/srv/it's", "STORE"),
    ("C:\\ckpts\\u0041", "'C:\\ckpts\\u0041'"),
    ("/srv/époque", "/srv/époque"),
])
def test_any_store_url_gives_a_pointer_that_reads_back(store, shown):
    ptr = {"store": store, "ref": "run/last", "root": ROOT, "step": 7, "job": "run"}
    data = pointer_bytes(ptr)
    assert data.count(b"\n") == 5  # nothing in the URL breaks a line of the preamble
    back, why = parse_pointer(data)
    assert why is None and back == {**ptr, "format": "tensorstore_ck.lightning-pointer/2"}
    with pytest.raises(tsck.FormatError) as e:
        torch.load(io.BytesIO(data), weights_only=False)
    assert f"tsck checkout {shown} {ROOT} OUT.ckpt --format lightning" in str(e.value)
    with pytest.raises(pickle.UnpicklingError, match="load_with_tensorstore_ck_lightning_load_checkpoint"):
        torch.load(io.BytesIO(data))


def test_what_is_not_a_pointer():
    good = pointer_bytes({"store": "/s", "ref": "r/x", "root": ROOT, "step": None, "job": "r"})
    assert parse_pointer(good.replace(b'"root"', b'"rooty"'))[0] is None
    assert "no preamble" in parse_pointer(good.splitlines()[-1])[1]
    assert "torch.save" in parse_pointer(b"PK\x03\x04")[1]
    assert "larger" in parse_pointer(good + b" " * 20000)[1]
