"""`tsck` commands that only read refs and manifests never import torch (its import is
~3 s of a ~3.6 s start here): the grammar needs dtype names and item sizes only, and
torch is loaded where tensors are (put, checkout, import, export)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import tensorstore_ck as tsck
from tensorstore_ck.format.dtypes import DTYPE_ITEMSIZES, PACKED_QUANT_NAMES, QUANT_NAMES

from _util import NO_TORCH_CLI

def test_the_grammar_table_is_this_torch_builds_dtypes():
    """The static table the grammar checks names against is exactly torch's (the pinned
    build): a name torch knows and the table lacks would be refused on read, and the
    reverse accepted without a torch dtype to rebuild it."""
    got = {str(v).removeprefix("torch."): v.itemsize for v in vars(torch).values() if isinstance(v, torch.dtype)}
    assert DTYPE_ITEMSIZES == got
    assert QUANT_NAMES <= set(got) and PACKED_QUANT_NAMES <= QUANT_NAMES
    assert {str(d).removeprefix("torch.") for d in (torch.quint4x2, torch.quint2x4)} == PACKED_QUANT_NAMES


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    p = tmp_path_factory.mktemp("nt") / "s"
    g = torch.Generator().manual_seed(0)
    with tsck.open_store(str(p)) as s:
        s.put_snapshot({"w": torch.randn(300, 100, generator=g), "h": torch.zeros(4, dtype=torch.bfloat16),
                        "sh": tsck.Sharded(torch.ones(2, 3), (2, 3), (0, 0)), "n": 3}, ref="j/main", step=1)
        s.put_snapshot({"w": torch.randn(300, 100, generator=g), "h": torch.zeros(4, dtype=torch.bfloat16), "n": 4},
                       ref="j/main", step=2)
        s.tag("t1", "j/main@1")
    return str(p)


@pytest.mark.parametrize("cmd", [
    ["refs"], ["log", "j/main"], ["show", "j/main"], ["du"], ["diff", "j/main@1", "j/main"],
    ["ls", "j/main"], ["ls", "t1"], ["fsck"], ["fsck", "--quick"], ["gc", "--dry-run"], ["gc"],
    ["retention", "j"], ["pin", "j/main"], ["recover"],
], ids=lambda c: "-".join(c))
def test_commands_that_read_refs_and_manifests_start_without_torch(store_path, cmd):
    argv = [cmd[0], store_path, *cmd[1:]]
    p = subprocess.run([sys.executable, "-c", NO_TORCH_CLI, *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, (argv, p.stdout, p.stderr)
    assert "torch imported" not in p.stderr


def test_a_command_that_needs_tensors_still_gets_torch(store_path, tmp_path):
    """The blocker bites: checkout to a .pt file needs torch and says so."""
    argv = ["checkout", store_path, "j/main", str(tmp_path / "x.pt")]
    p = subprocess.run([sys.executable, "-c", NO_TORCH_CLI, *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "torch imported by a command" in p.stdout + p.stderr, (p.stdout, p.stderr)


def test_a_name_the_installed_torch_lacks_is_a_format_error():
    from tensorstore_ck.errors import FormatError
    from tensorstore_ck.format.dtypes import torch_dtype
    assert torch_dtype("bfloat16") is torch.bfloat16
    with pytest.raises(FormatError, match="not known to the installed torch"):
        torch_dtype("float3_e1m1")
