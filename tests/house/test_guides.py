"""docs/guide/*.md run as a reader would run them: every ```python block (in a process of
its own; one that starts with `# NAME.py:` is written to NAME.py instead) and every
```sh line (`tsck ...` through the real entry point, `torchrun ...` through
torch.distributed.run, `export K=V` into the environment of what follows), in order,
each required to succeed. The guides' placeholders become this test's servers and
folders: s3://my-bucket/ a fresh prefix on the session's S3 server (moto, or radosgw in
CI), postgresql://db-host/tsck the session's PostgreSQL, /data/ckpt and /nvme/tsck
folders under tmp_path; the S3 credentials and endpoint go in the environment, where
the guides tell users to put them."""

from __future__ import annotations

import os
import re
import shlex
import sys
import uuid
from pathlib import Path

import pytest

import tensorstore_ck as tsck

import _zygote as zygote

GUIDE_DIR = Path(__file__).resolve().parents[2] / "docs" / "guide"
GUIDES = sorted(p.stem for p in GUIDE_DIR.glob("*.md") if p.name != "README.md")
BLOCK = re.compile(r"^```(python|sh)\n(.*?)^```", re.S | re.M)
NEEDS = {"s3": {"s3"}, "postgresql": {"s3", "pg"}, "tier": {"s3"}, "torchrun": set(), "operating": set(),
         "training": set(), "goodput": set(), "accelerate": set(), "torchtitan": set()}

pytestmark = pytest.mark.slow  # servers, subprocesses with torch, torchrun


def _blocks(name: str) -> list[tuple[str, str]]:
    return BLOCK.findall((GUIDE_DIR / f"{name}.md").read_text())


def test_every_guide_is_run_and_listed():
    assert set(GUIDES) == set(NEEDS), "a guide without a run here, or a run without its guide"
    index = (GUIDE_DIR / "README.md").read_text()
    for name in GUIDES:
        assert f"({name}.md)" in index, f"docs/guide/README.md does not list {name}.md"
        assert any(kind == "python" for kind, _ in _blocks(name)), f"{name}.md has no runnable snippet"


@pytest.fixture
def guide_env(request, tmp_path):
    """The placeholders' replacements and the environment, for the servers `name` needs."""
    name = request.param
    subs = {"/data/ckpt-refs.lmdb": str(tmp_path / "refs.lmdb"), "/data/ckpt": str(tmp_path / "ckpt"),
            "/nvme/tsck": str(tmp_path / "tier")}
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "TSCK_", "PG"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(tsck.__file__).resolve().parents[1]),
                                         env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if "s3" in NEEDS[name]:
        opts = request.getfixturevalue("s3_server")
        subs["s3://my-bucket/"] = f"s3://tsck-tests/{uuid.uuid4().hex}/"
        env.update(AWS_ACCESS_KEY_ID=opts["key"], AWS_SECRET_ACCESS_KEY=opts["secret"],
                   AWS_ENDPOINT_URL=opts["endpoint_url"])
    if "pg" in NEEDS[name]:
        from psycopg.conninfo import conninfo_to_dict
        d = conninfo_to_dict(request.getfixturevalue("pg_dsn"))  # as a URL, the guides' form
        subs["postgresql://db-host/tsck"] = (f"postgresql://{d.get('user', 'postgres')}@{d.get('host', '127.0.0.1')}:"
                                             f"{d.get('port', 5432)}/{d.get('dbname', 'postgres')}")
    return name, subs, env


def _sub(text: str, subs: dict) -> str:
    for k in sorted(subs, key=len, reverse=True):  # /data/ckpt-refs.lmdb before /data/ckpt
        text = text.replace(k, subs[k])
    return text


def _run(cmd: list[str], env: dict, cwd: Path, what: str) -> str:
    # (what the commands start, torchrun's agent and ranks included: forks of the zygote)
    p = zygote.run(cmd, env=dict(env, **{zygote.SUBPROCESS: "1"}), cwd=cwd, capture_output=True, text=True,
                   timeout=600)
    assert p.returncode == 0, f"{what} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p.stdout


@pytest.mark.parametrize("guide_env", GUIDES, indirect=True)
def test_guide_runs(guide_env, tmp_path):
    name, subs, env = guide_env
    out = []
    for k, (kind, text) in enumerate(_blocks(name)):
        text = _sub(text, subs)
        if kind == "python":
            first = text.splitlines()[0]
            m = re.match(r"# (\w+\.py):", first)
            path = tmp_path / (m.group(1) if m else f"block{k}.py")
            path.write_text(text)
            if not m:
                out.append(_run([sys.executable, str(path)], env, tmp_path, f"{name}.md python block {k}"))
            continue
        for line in text.splitlines():
            argv = shlex.split(line, comments=True)
            if not argv:
                continue
            if argv[0] == "export":
                k_, _, v = argv[1].partition("=")
                if v != "..." and not k_.startswith("AWS_"):  # the test's own credentials stay
                    env[k_] = v
                continue
            prog = {"tsck": [sys.executable, "-m", "tensorstore_ck"],
                    "torchrun": [sys.executable, "-m", "torch.distributed.run"]}[argv[0]]
            out.append(f"$ {line.strip()}\n" + _run(prog + argv[1:], env, tmp_path, f"{name}.md: {line.strip()}"))
    said = {o.split("\n", 1)[0]: o.split("\n", 1)[1] for o in out if o.startswith("$ ")}
    # What each guide says the reader will see.
    if name == "torchrun":
        with tsck.open_store(subs["/data/ckpt"], create=False) as s:
            assert [i.step for i in s.log("ddp/main")][0] == 20  # the second run went on from 10 to 20
    if name == "operating":
        with tsck.open_store(subs["/data/ckpt"], create=False) as s:
            # keep_last 2 kept 5 and 6; delete-ref then undelete brings the ref back on 6
            assert [i.step for i in s.log("llm/main")] == [6]
            log = said[f"$ tsck log {subs['/data/ckpt']} llm/main"]  # before the delete-ref
            assert re.findall(r"step\s+(\d+)\s", log) == ["6", "5"], log
            assert s.resolve("llm-best") == s.resolve("llm/main@6")
    if name == "training":  # the second run resumed at 10 and went on to 20; retention kept 3 and the best
        with tsck.open_store(subs["/data/ckpt"], create=False) as s:
            steps = [i.step for i in s.log("llm/main")]
            assert steps[0] == 20 and len(steps) <= 4, steps
    if name == "tier":  # tsck log after wait_durable(): every snapshot uploaded
        log = next(v for k, v in said.items() if k.startswith("$ tsck log"))
        assert "step       30" in log and "local-only" not in log, log
