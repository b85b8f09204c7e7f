"""A CheckpointManager and the preemption signal (tensorstore_ck/train/preempt.py), in real
processes sent a real SIGTERM: the step after the notice is saved, blocking, and the process
ends with Preempted's status (143); a handler the program installed still runs; a loop that
never reaches step() again ends within the grace, as the signal would have ended it; a
manager made with preempt_signals=() leaves the signal alone. Several ranks:
tests/train/test_dist_manager.py."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys

import pytest
import torch

import tensorstore_ck as tsck
from _util import REPO, child_env, same_bits

CHILD = r"""
import json, os, signal, sys, time
import torch
import tensorstore_ck as tsck

out, mode = sys.argv[1], sys.argv[2]
heard = []
if mode == "chained":
    signal.signal(signal.SIGTERM, lambda s, f: heard.append(s))
wrap = None
if mode == "slow":  # a store whose first commit takes 1.5 s (longer than the grace, 1 s), the next 0.5 s
    from tensorstore_ck.storage.wrappers import WrappedStore
    commits = []
    class Slow(WrappedStore):
        def put_if_absent(self, key, bufs):
            if key.startswith("commits/"):
                commits.append(key)
                time.sleep(1.5 if len(commits) == 1 else 0.5)  # (the final one well inside the watchdog's end, grace + 5 s)
            return self.inner.put_if_absent(key, bufs)
    wrap = Slow
store = tsck.open_store(os.path.join(out, "store"), wrap_storage=wrap)
torch.manual_seed(0)
model = torch.nn.Linear(8, 8)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
kw = {"preempt_signals": ()} if mode == "off" else {}
if mode == "slow":
    kw.update(preempt_grace=1, async_=False)
mgr = tsck.CheckpointManager(store, job="j", state={"model": model, "opt": opt},
                             every_steps=3 if mode == "slow" else 10**6,
                             **{"preempt_grace": 2 if mode == "stuck" else 60, **kw})
for step in range(1, 10**6):
    loss = model(torch.randn(4, 8)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    torch.save(model.state_dict(), os.path.join(out, f"w{step}.pt"))
    try:
        mgr.step(step)
    except tsck.Preempted as e:
        with open(os.path.join(out, "res.json"), "w") as f:
            json.dump({"step": e.step, "durable": e.durable, "code": e.code, "heard": heard, "text": str(e)}, f)
        raise
    print(f"step {step}", flush=True)  # (after step(): the notice comes after this step's)
    if step == 3:
        if mode == "stuck":
            time.sleep(3600)  # a long evaluation: no step() comes again
        input()  # wait here for the test's notice, then go on training
"""


def _run(tmp_path, mode: str) -> tuple[subprocess.Popen, str]:
    """The child trains to step 3 and waits there (on stdin); SIGTERM is sent then, and the
    child told to go on. -> (the process, ended; its stdout)."""
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), mode], cwd=REPO, env=child_env(),
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in p.stdout:
        seen.append(line)
        if line.strip() == "step 3":
            break
    p.send_signal(signal.SIGTERM)
    try:
        p.stdin.write("go\n")
        p.stdin.flush()
    except BrokenPipeError:
        pass  # (it ended at the signal)
    out, err = p.communicate(timeout=120)
    return p, "".join(seen) + out + err


def test_sigterm_saves_the_next_step_and_ends_with_143(tmp_path):
    p, text = _run(tmp_path, "plain")
    assert p.returncode == 143, text
    res = json.loads((tmp_path / "res.json").read_text())
    assert (res["step"], res["durable"], res["code"]) == (4, True, 143), res
    assert "step 4" in res["text"] and "SIGTERM" in res["text"]
    with tsck.open_store(tmp_path / "store", create=False) as s:
        [info] = s.log("j/main")
        assert info.step == 4 and info.meta["triggers"] == ["preempted"]
        got = s.checkout("j/main")["model"]
    want = torch.load(tmp_path / "w4.pt")
    assert all(same_bits(got[k], want[k]) for k in want)


def test_a_handler_the_program_installed_still_runs(tmp_path):
    p, text = _run(tmp_path, "chained")
    assert p.returncode == 143, text
    res = json.loads((tmp_path / "res.json").read_text())
    assert res["step"] == 4 and res["heard"] == [signal.SIGTERM]


def test_a_loop_that_never_steps_again_ends_within_the_grace(tmp_path):
    """The notice comes during a long evaluation: nothing is saved, and the process ends
    when the grace (2 s) is over, with the status the signal's default action reports."""
    p, text = _run(tmp_path, "stuck")
    assert p.returncode == 143, text
    assert not (tmp_path / "res.json").exists()
    assert "no CheckpointManager.step() came within 2 s" in text
    with tsck.open_store(tmp_path / "store", create=False) as s:
        assert "j/main" not in s.refs()


def test_a_final_snapshot_longer_than_the_grace_left_is_warned_and_still_tried(tmp_path):
    """The snapshot of step 3 took 1.5 s; the grace is 1 s: before the final save a
    SnapshotWarning says it may not fit, the save is still tried, and Preempted says it
    made it (it took 0.5 s: one process's put is bounded only by the watchdog, PAST_GRACE
    after the grace)."""
    p, text = _run(tmp_path, "slow")
    assert p.returncode == 143, text
    assert re.search(r"the last snapshot took 1\.\d s and [01]\.\d s of the grace \(1 s\) are left", text), text
    assert "may not fit" in text, text
    res = json.loads((tmp_path / "res.json").read_text())
    assert (res["step"], res["durable"]) == (4, True), res
    with tsck.open_store(tmp_path / "store", create=False) as s:
        assert [i.step for i in s.log("j/main")] == [4, 3]


def test_preempt_signals_off_leaves_the_signal_alone(tmp_path):
    p, text = _run(tmp_path, "off")
    assert p.returncode == -signal.SIGTERM, text
    assert not (tmp_path / "res.json").exists()


@pytest.mark.parametrize("kw,why", [({"preempt_grace": 0}, "preempt_grace"), ({"on_preempt": "exit"}, "on_preempt"),
                                    ({"preempt_signals": ("TERM",)}, "preempt_signals")])
def test_bad_preemption_options_are_refused_and_install_nothing(tmp_path, kw, why):
    before = signal.getsignal(signal.SIGTERM)
    with tsck.open_store(tmp_path / "s") as s:
        with pytest.raises(tsck.InvalidArgument, match=why):
            tsck.CheckpointManager(s, job="j", state={"x": torch.zeros(2)}, **kw)
    assert signal.getsignal(signal.SIGTERM) is before


def test_close_puts_the_handler_back(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    with tsck.open_store(tmp_path / "s") as s:
        mgr = tsck.CheckpointManager(s, job="j", state={"x": torch.zeros(2)}, every_steps=1)
        assert signal.getsignal(signal.SIGTERM) is not before
        mgr.close()
    assert signal.getsignal(signal.SIGTERM) is before
