"""The Lightning pointer file without Lightning (tensorstore_ck.ckpt_pointer): any store URL
gives a text file of four lines whose JSON reads back as written, and torch.load of it, with
torch's default loader (weights_only=True) or without it, stops at the preamble with the
pointer's own message, never runs past it. Stored bytes are never unpickled."""
from __future__ import annotations

import io
import json
import pickle

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.ckpt_pointer import POINTER_FORMAT, parse_pointer, pointer_bytes

ROOT = "ab" * 32


def _load_error(data: bytes, **kw) -> str:
    with pytest.raises(Exception) as e:
        torch.load(io.BytesIO(data), **kw)
    return str(e.value)


@pytest.mark.parametrize("store, shown", [
    ("file:///srv/ckpts", "file:///srv/ckpts"),
    ("/srv/my runs/ckpts", "'/srv/my runs/ckpts'"),
    ("/srv/a\nb", "STORE"),
    ("/srv/it's", "STORE"),
    ("C:\\ckpts\\u0041", "'C:\\ckpts\\u0041'"),
    ("/srv/époque", "/srv/époque"),
    ("/srv/" + "x" * 500, "/srv/" + "x" * 500),
])
def test_any_store_url_gives_a_pointer_that_reads_back(store, shown):
    ptr = {"store": store, "ref": "run/last", "root": ROOT, "step": 7, "job": "run"}
    data = pointer_bytes(ptr)
    data.decode("utf-8")  # a text file: cat shows it, read_text() reads it
    assert data.count(b"\n") == 4  # nothing in the URL or the message's length breaks a line of the preamble
    back, why = parse_pointer(data)
    assert why is None and back == {**ptr, "format": POINTER_FORMAT}
    command = f"tsck checkout {shown} {ROOT} OUT.ckpt --format lightning"
    # torch's default loader (weights_only=True) and the full unpickler say the same: the pointer's message,
    # not torch's advice to allowlist a global or to load with weights_only=False
    for kw in ({}, {"weights_only": True}, {"weights_only": False}):
        msg = _load_error(data, **kw)
        assert "is not a torch checkpoint but a tensorstore_ck pointer" in msg and command in msg, kw
        assert "weights_only" not in msg and "add_safe_globals" not in msg, kw


def test_a_version_2_pointer_still_reads():
    """Files the previous writer left: the preamble that calls a function of this module."""
    ptr = {"store": "/s", "ref": "r/x", "root": ROOT, "step": 3, "job": "r",
           "format": "tensorstore_ck.lightning-pointer/2"}
    data = (b"ctensorstore_ck.ckpt_pointer\nload_with_tensorstore_ck_lightning_load_checkpoint\n(Vthe message\ntR.\n"
            + json.dumps(ptr, sort_keys=True).encode() + b"\n")
    assert parse_pointer(data) == (ptr, None)
    with pytest.raises(tsck.FormatError, match="the message"):
        torch.load(io.BytesIO(data), weights_only=False)
    with pytest.raises(pickle.UnpicklingError, match="load_with_tensorstore_ck_lightning_load_checkpoint"):
        torch.load(io.BytesIO(data))
    # the version 3 preamble before a version 2 JSON line is not one
    v3 = pointer_bytes({k: v for k, v in ptr.items() if k != "format"})
    assert "no preamble" in parse_pointer(v3.replace(POINTER_FORMAT.encode(), ptr["format"].encode()))[1]


def test_what_is_not_a_pointer():
    good = pointer_bytes({"store": "/s", "ref": "r/x", "root": ROOT, "step": None, "job": "r"})
    assert parse_pointer(good.replace(b'"root"', b'"rooty"'))[0] is None
    assert "no preamble" in parse_pointer(good.splitlines()[-1])[1]
    assert "torch.save" in parse_pointer(b"PK\x03\x04")[1]
    assert "larger" in parse_pointer(good + b" " * 20000)[1]
