"""What the harness's tier writers found, pinned as plain tests (tests/sim/, docs/TESTING.md).

An upload killed after its remote ref move and before the tier's durable mark resumes
at the next open of the tier. By then the remote ref may have moved on (other writers'
puts) and retention may have expired the snapshot there: the resumed upload must not
move the ref back to it.
"""
from __future__ import annotations

import os
import signal
import sys

import torch

import tensorstore_ck as tsck

import _zygote as zygote

_KILLED_AFTER_MOVE = r"""
import os, signal, sys, torch
import tensorstore_ck as tsck
s = tsck.open_store(sys.argv[1], local=sys.argv[2])
up = s._tier.uploader
def done(*a, **k):  # the remote ref moved, the tier not told: kill -9 here
    os.kill(os.getpid(), signal.SIGKILL)
up.local.refs.tier_rows.upload_done = done
s.put_snapshot({"w": torch.full((4096,), 1.0)}, ref="job/main", step=1)
s.wait_durable(timeout=120)
"""


def test_an_upload_resumed_after_its_move_never_moves_the_ref_back(tmp_path):
    url, tier = str(tmp_path / "store"), str(tmp_path / "tier")
    tsck.open_store(url).close()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH")) if p)}
    p = zygote.run([sys.executable, "-c", _KILLED_AFTER_MOVE, url, tier], env=env, capture_output=True,
                   text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr[-2000:]
    with tsck.open_store(url) as remote:
        old = remote.resolve("job/main")  # the move landed before the kill
        new = remote.put_snapshot({"w": torch.full((4096,), 2.0)}, ref="job/main", step=2).root
        remote.set_retention("job", tsck.Retention(keep_last=1))
        remote.prune("job")
        assert remote.reftable.catalog_get(bytes.fromhex(old)) is None  # expired remotely
    with tsck.open_store(url, local=tier) as s:  # the upload of step 1 resumes
        assert s.wait_durable(timeout=120)
    with tsck.open_store(url) as remote:
        assert remote.resolve("job/main") == new, "the resumed upload moved the ref back to step 1"
        assert remote.checkout("job/main")["w"][0].item() == 2.0
