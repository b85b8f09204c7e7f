"""The pointer file TsckCheckpointIO writes at a Lightning checkpoint path, without Lightning.

A pointer names a snapshot (store, ref, root, step, job) in one line of JSON. Tools that
expect a torch.save file there (torch.load, `Net.load_from_checkpoint`, LightningCLI, a
model registry) can only say what torch says of a file it cannot read, so a pointer
begins with a short pickle that torch.load reads first, and that fails with the pointer's
own message under either of torch's loaders:

    c_codecs                                GLOBAL _codecs.encode
    encode
    (NX<u32 length><message>tR.             MARK, NONE, BINUNICODE, TUPLE, REDUCE, STOP
    {"format": "tensorstore_ck.lightning-pointer/3", ...}

That is `_codecs.encode(None, message)`: a call torch's weights_only unpickler (torch's
default loader, and `Net.load_from_checkpoint`'s) allows, as does plain pickle
(weights_only=False), and one that raises LookupError("unknown encoding: <message>")
before it encodes anything. torch wraps only its unpickler's own errors in its advice
(add_safe_globals, weights_only=False); a LookupError reaches the caller as it is, so
what torch.load of a pointer says is the message: what the file is, the store, the
snapshot and the `tsck checkout` that writes a real .ckpt. This module never unpickles
anything: a reader takes the JSON of the last line.

Version 2 files (a GLOBAL of load_with_tensorstore_ck_lightning_load_checkpoint below, which
torch's default loader refuses by name with its own advice) and version 1 files (the JSON
line alone) are read as before.

Here rather than in lightning.py so that `tsck checkout` (the base package, no Lightning)
takes a pointer file as its TARGET.
"""

from __future__ import annotations

import json
import os
import struct

from .errors import FormatError
from .util.localfile import NotRegularFile, open_regular

__all__ = ["POINTER_FORMAT", "POINTER_FORMATS", "MAX_POINTER_BYTES", "parse_pointer", "pointer_bytes",
           "read_local_pointer", "load_with_tensorstore_ck_lightning_load_checkpoint"]

POINTER_FORMAT = "tensorstore_ck.lightning-pointer/3"
POINTER_FORMATS = ("tensorstore_ck.lightning-pointer/1", "tensorstore_ck.lightning-pointer/2",
                   POINTER_FORMAT)  # what a reader takes
# A pointer is well under 1 KiB (twice that with a long store URL); anything bigger is
# something else (a torch checkpoint).
MAX_POINTER_BYTES = 16384
_HEAD = b"c_codecs\nencode\n(NX"  # version 3: GLOBAL _codecs.encode, MARK, NONE, BINUNICODE
_HEAD_V2 = b"ctensorstore_ck.ckpt_pointer\nload_with_tensorstore_ck_lightning_load_checkpoint\n"
_HEADS = {POINTER_FORMATS[1]: _HEAD_V2, POINTER_FORMAT: _HEAD}


def load_with_tensorstore_ck_lightning_load_checkpoint(message: str):
    """What torch.load(weights_only=False) of a version 2 pointer file calls: raise its message."""
    raise FormatError(str(message))


def _message(ptr: dict) -> str:
    store = ptr.get("store")
    # The command is for a shell: a store URL that is long or holds odd characters is left out.
    if not isinstance(store, str) or len(store) > 512 or not store.isprintable() or "'" in store:
        store = "STORE"
    elif any(c in store for c in " \"$`\\;&|<>()*?[]{}!#~"):
        store = f"'{store}'"
    return (f"this file is not a torch checkpoint but a tensorstore_ck pointer to snapshot {ptr['root'][:16]} "
            f"(ref {ptr['ref']}, step {ptr.get('step')}) in the store {store}: load it with "
            f"tensorstore_ck.lightning.load_checkpoint(path), or Net.load_from_checkpoint("
            f"tensorstore_ck.lightning.open_checkpoint(path)), or write a real .ckpt with: "
            f"tsck checkout {store} {ptr['root']} OUT.ckpt --format lightning")


def pointer_bytes(ptr: dict) -> bytes:
    """The file for pointer `ptr` (format, store, ref, root, step, job): the pickle preamble,
    then the JSON line."""
    ptr = {**ptr, "format": POINTER_FORMAT}
    text = _message(ptr).encode("utf-8", "replace")
    # Trailing spaces, invisible in the message, keep the length's bytes below 0x80 and off
    # the line breaks: the file stays UTF-8 text (what `cat` shows, what read_text() reads)
    # whose lines are the preamble's, then the JSON.
    while any(b >= 0x80 or b in (0x0A, 0x0D) for b in struct.pack("<I", len(text))):
        text += b" "
    return _HEAD + struct.pack("<I", len(text)) + text + b"tR.\n" + json.dumps(ptr, sort_keys=True).encode() + b"\n"


def parse_pointer(data: bytes) -> tuple[dict | None, str | None]:
    """(pointer, None), or (None, why the bytes are not one). Never unpickles: a version 2
    or 3 file's JSON is its last line."""
    if data[:2] == b"PK" or data[:1] == b"\x80":
        return None, "it looks like a torch.save checkpoint (load it with Lightning's TorchCheckpointIO)"
    if len(data) > MAX_POINTER_BYTES:
        return None, f"it is larger than a pointer file ({MAX_POINTER_BYTES} bytes)"
    body = data
    if data.startswith((_HEAD, _HEAD_V2)):
        body = data.rstrip(b"\n").rpartition(b"\n")[2]
    try:
        ptr = json.loads(body)
    except (UnicodeDecodeError, ValueError) as e:
        return None, f"it is not JSON ({e})"
    if not isinstance(ptr, dict) or ptr.get("format") not in POINTER_FORMATS or not isinstance(ptr.get("root"), str) \
            or not isinstance(ptr.get("ref"), str):
        return None, f"it is not a {POINTER_FORMAT} file"
    head = _HEADS.get(ptr["format"])
    if head is not None and not data.startswith(head):
        return None, f"it is not a {ptr['format']} file (no preamble)"
    return ptr, None


def read_local_pointer(path) -> tuple[dict | None, str | None]:
    """(pointer, None), (None, why not) for a local file that is not one; FileNotFoundError
    and the like propagate. Reads a regular file only (a FIFO would wait for a writer)."""
    p = os.fspath(path)
    try:
        with open(open_regular(p), "rb") as f:
            return parse_pointer(f.read(MAX_POINTER_BYTES + 1))
    except NotRegularFile as e:
        return None, "it " + e.strerror.removeprefix(f"{p} ")  # "it is a FIFO, not a regular file"
