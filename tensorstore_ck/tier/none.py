"""NoTier: what a Store without a local tier holds in its tier's place, so the Store asks
one object the same questions whether or not it has a tier (tier/local.py's LocalTier is
the other answer): its own store is the only one, every snapshot is durable when it
commits, and a target names one root."""

from __future__ import annotations

from ..core.core import Core

__all__ = ["NoTier", "NoCollective"]


class NoTier:
    """The do-nothing tier: each answer is the one store's own."""

    uploads = False          # no uploader: nothing queued, nothing to wait for
    costs_requests = False   # a put's objects go where the store is (its pack default)
    learns_parts = True      # a checkout's parts are this store's own (packparts.PartIndex)
    remote = None            # no remote store behind

    def __init__(self, core: Core):
        self.core = core

    # -- a put -----------------------------------------------------------------------
    def begin(self) -> None:
        pass

    def published(self, info):
        return info

    @staticmethod
    def scheduled(args):
        return args

    def collective(self) -> "NoCollective":
        return NoCollective()

    def wait_durable(self, timeout: float | None) -> bool:
        return True

    def on_durable(self, heard):
        return lambda: None

    def lag(self):
        return None

    def set_retention(self, job: str, record: dict | None) -> None:
        pass

    # -- naming and reading ------------------------------------------------------------
    def roots(self, target: str) -> list:
        return [self.core.resolve(target)]

    def read_core(self) -> Core:
        return self.core

    def remote_info(self, root: bytes):
        return None  # (no remote: nothing read)

    def history_core(self, ref: str) -> Core:
        return self.core

    def reads_for(self, collective: bool):
        return self.core.assets

    own_tip = newest_of = None  # (one table for all ranks: rank 0 resolves what every rank holds)

    @staticmethod
    def served(reads):
        return reads

    @staticmethod
    def reading():
        import contextlib
        return contextlib.nullcontext()

    @staticmethod
    def read_plan(served, commit):
        return None

    def source(self, served) -> tuple[str, str]:
        return "store", f"the store at {self.core.url}"

    # -- tags, pins, removals: the store's own (maintain/lifecycle.py) -----------------
    # (named_of(target): the root a tier's call names, or None: LocalTier's; not asked here)
    def tag(self, publisher, name: str, target: str, named_of):
        from ..maintain import lifecycle
        return lifecycle.tag(self.core, publisher, name, target), False

    def pin(self, publisher, target: str, named_of) -> str:
        from ..maintain import lifecycle
        return lifecycle.pin(self.core, publisher, target)

    def unpin(self, root: bytes) -> None:
        self.core.refs.unpin(root)

    def delete_ref(self, ref: str, expected, named_of, *, dry_run: bool) -> dict:
        from ..maintain import lifecycle
        return lifecycle.delete_ref(self.core, ref, expected, dry_run=dry_run)

    def undelete(self, publisher, ref: str, to, named_of):
        from ..maintain import lifecycle
        return lifecycle.undelete(self.core, publisher, ref, to), False

    def untag(self, name: str) -> str:
        from ..maintain import lifecycle
        return lifecycle.untag(self.core, name)

    def forget(self, publisher, target: str, root_of, info_of, *, dry_run: bool):
        from ..maintain import lifecycle
        return lifecycle.forget(self.core, publisher, target, dry_run=dry_run)

    # -- the process -----------------------------------------------------------------
    def after_fork(self) -> None:
        pass

    def close(self, deadline: float | None, path: str, stacklevel: int) -> None:
        pass

    def unheard(self):
        return None


class NoCollective:
    """What a collective put does besides the protocol without tiers: nothing (tier/
    collective.py's CollectiveTier is the other answer): every rank writes under rank 0's
    fence into the one store, where rank 0 publishes."""

    own_tables = False

    def make_room(self) -> None:
        pass

    @staticmethod
    def write_fence(rank: int, fence: int, publisher) -> int:
        return fence

    @staticmethod
    def part0(tree: bytes) -> None:
        return None

    @staticmethod
    def commit_meta(ref: str) -> dict:
        return {}

    def intend(self, part: bytes, args) -> None:
        pass

    def post_top(self, ch, root: bytes, payloads: list, world: int) -> None:
        pass

    def adopt_posted(self, ch, root: bytes, part: bytes) -> None:
        pass

    @staticmethod
    def agrees_after(info) -> bool:
        return False

    def published(self, info, tree: bytes, rank0: bool, ch=None):
        return info

    def abandon(self, part: bytes) -> None:
        pass
