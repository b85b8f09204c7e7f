"""One catalog across a local tier and its remote store (docs/design/tiers.md, "One
catalog" and "One answer"): a tag or pin made in the tier is made in the remote table too,
so that the remote's retention, an offline gc of the remote and a node that lost its tier
keep what the tier keeps; a tag or pin of a snapshot only the remote lists is made there;
a removal (delete_ref, forget, untag) and an undelete act in both tables, or refuse,
naming the remote, with nothing changed. Functions of the Uploader `up` (its local and
remote cores, the remote's publisher and the queue)."""

from __future__ import annotations

import contextlib
import logging
from typing import Protocol

from ..core.core import Core
from ..core.roles import UploadQueue
from ..errors import IntegrityError, InvalidArgument, RefConflict, RefNotFound, StorageError, TsckError
from ..refs import RefTable
from ..util.ids import MIN_PREFIX, is_hex_prefix
from ..write.publish import Publisher

__all__ = ["Uploads", "publish_holds", "held", "unheld", "upload_hold", "tag_both", "pin_both", "untag_both", "forget_both",
           "delete_ref_both", "undelete_both", "REMOVE_WAIT"]

log = logging.getLogger(__name__)


class Uploads(Protocol):
    """What the holds and the removals in both tiers use of a tier's uploader (the role
    tier/uploader.py's Uploader plays): the tier's Core and its queue, the remote's Core and
    its publisher, and an upload's steps."""

    local: Core[UploadQueue]
    remote: Core[RefTable]
    publisher: Publisher

    def read_fence(self) -> int: ...

    def walk(self, root: bytes) -> dict: ...

    def send(self, objs: dict, fence: int) -> None: ...

    def expired(self, seq: int, root: bytes) -> None: ...

    def notify(self) -> None: ...

    def wait_unsent(self, roots: set, timeout: float) -> bool: ...

# How long a delete_ref through a tier waits for an upload of one of the ref's snapshots
# already in flight (it would move the remote ref after the removal) before it removes the
# remote ref all the same.
REMOVE_WAIT = 60.0


def _holds(up: Uploads, root: bytes) -> tuple[list[str], bool]:
    refs = up.local.refs
    return [name for name, r in refs.tags() if r == root], root in refs.pins()


def publish_holds(up: Uploads, root: bytes) -> None:
    """The tags and pins that name `root` in the tier, made in the remote table too
    (and a tag's storage object, which recover rebuilds it from), so that the remote's
    retention, an offline `tsck gc` of the remote and a node that lost its tier keep
    what the tier keeps. The remote must list `root` or hold all of it (a tag or pin
    there adopts it then: lifecycle.tag, lifecycle.pin). A remote tag of that name
    naming another snapshot (another tier's) is left, with a warning."""
    from ..maintain.lifecycle import pin, tag
    names, pinned = _holds(up, root)
    remote = up.remote.refs
    for name in names:
        have = remote.tag_get(name)
        if have == root:
            continue
        if have is not None:
            log.warning("local tier: tag %r names snapshot %s here but %s at %s; the remote's is left as it is",
                        name, root.hex()[:16], have.hex()[:16], up.remote.url)
            continue
        tag(up.remote, up.publisher, name, root.hex())
    if pinned and root not in remote.pins():
        pin(up.remote, up.publisher, root.hex())


def held(up: Uploads, root: bytes) -> None:
    """A tag or pin naming `root` was just made in the tier: make it the remote's
    too. Now, when the remote catalog lists `root`; when it does not and `root` is
    queued, its upload publishes it (publish_holds runs after the remote move, which
    comes after this look); else (a snapshot the backlog rule skipped, one the remote
    retention expired, a remote away) it is queued to be sent for its holds alone,
    into the remote catalog without moving the remote ref (upload_hold)."""
    refs = up.local.refs
    try:
        if up.remote.refs.catalog_has(root):
            publish_holds(up, root)
            return
    except (StorageError, TsckError, OSError) as e:
        log.warning("local tier: the tag or pin of %s could not be made at %s now (%s); the uploader makes it",
                    root.hex()[:16], up.remote.url, e)
    else:
        if any(e["root"] == root and not e.get("hold") for _, e in refs.tier_rows.upload_pending()):
            return
    row = refs.catalog_get(root, checked=False) or {}
    refs.tier_rows.upload_enqueue(root, row.get("ref"), row.get("step"), hold=True)
    up.notify()


def unheld(up: Uploads, tag_name: str | None = None, pin: bytes | None = None, root: bytes | None = None) -> None:
    """A tag or pin removed in the tier: removed in the remote table too, best
    effort (left there, it keeps more than asked, never less)."""
    from ..maintain.lifecycle import untag
    remote = up.remote
    try:
        if tag_name is not None and remote.refs.tag_get(tag_name) == root:
            untag(remote, tag_name)
        if pin is not None and pin in remote.refs.pins():
            remote.refs.unpin(pin)
    except (StorageError, TsckError, OSError) as e:
        log.warning("local tier: the %s stays at %s (%s); remove it there with `tsck %s`", "tag" if tag_name
                    else "pin", remote.url, e, f"untag {remote.url} {tag_name}" if tag_name
                    else f"unpin {remote.url} {pin.hex() if pin else ''}")


def upload_hold(up: Uploads, seq: int, root: bytes, row: dict) -> None:
    """An entry queued for the tags and pins of `root` (held): the remote gets the
    snapshot into its catalog with them, and its ref does not move (a newer snapshot
    may be its tip). What the remote lacks is sent first, as for any upload; the tag
    or pin then adopts the snapshot there (every object found present, fenced on the
    remote gc epoch: a deletion phase in between is waited out and the objects are
    looked at again)."""
    refs = up.local.refs
    names, pinned = _holds(up, root)
    if not names and not pinned:
        log.debug("local tier: snapshot %s was queued for a tag or pin that is gone; not sent", root.hex()[:16])
        refs.tier_rows.upload_drop(seq)
        return
    if not up.remote.refs.catalog_has(root) and root not in refs.tier_rows.evicted():
        fence = up.read_fence()
        try:
            up.send(up.walk(root), fence)
        except IntegrityError:
            if refs.catalog_get(root, checked=False) is None:
                up.expired(seq, root)
                return
            raise
    try:
        publish_holds(up, root)
    except IntegrityError as e:
        if root in refs.tier_rows.evicted():
            # Its local copy went to the budget and the remote no longer holds all of
            # it: neither tier can keep it now; said, not retried for ever.
            log.error("local tier: snapshot %s cannot be tagged or pinned at %s: %s; its local copy was "
                      "evicted, so no tier holds it whole", root.hex()[:16], up.remote.url, e)
            refs.tier_rows.upload_drop(seq)
            return
        # A remote gc removed some of what was sent before the tag or pin took it in:
        # sent again on the next try.
        raise StorageError(f"snapshot {root.hex()[:16]} is not whole at {up.remote.url} yet ({e})") from e
    refs.tier_rows.upload_done(seq, root)
    up.notify()
    log.debug("local tier: snapshot %s (step %s) durable at %s for its %s", root.hex()[:16], row.get("step"),
              up.remote.url, "tags and pin" if names and pinned else "tags" if names else "pin")


# -- one answer: names and removals in both tables (Store.tag, pin, untag, forget, ...) --

@contextlib.contextmanager
def _reaching(up: Uploads, what: str):
    """The remote table asked before anything changes: unreachable, the call is refused
    naming the remote store (StorageError), and nothing was changed in either table."""
    try:
        yield
    except (StorageError, OSError) as e:
        raise StorageError(f"{what}: the remote store at {up.remote.url} could not be reached ({e}); nothing was "
                           "changed in either tier (a removal through a local tier removes in both)") from e


def tag_both(up: Uploads, publisher, name: str, target: str, root: bytes | None):
    """Tag `root` (what the Store's one resolution named; None: nothing names `target`, a
    removed snapshot's full root) -> (SnapshotInfo, whether the tier made it). The name
    must be free in both tables (a tag or ref of it at the remote would give the name a
    second answer). A snapshot the tier lists is tagged there and the remote follows
    (held); one only the remote lists is tagged at the remote."""
    from ..maintain.lifecycle import check_free, tag
    local, remote = up.local, up.remote
    check_free(local.refs, name)
    with _reaching(up, f"tag {name!r}"):
        check_free(remote.refs, name, besides=root)
    if root is None:  # a removed snapshot, adopted by the tier that still holds it whole
        try:
            return tag(local, publisher, name, target), True
        except RefNotFound:
            return tag(remote, up.publisher, name, target), False
    if local.refs.catalog_has(root):
        info = tag(local, publisher, name, root.hex())
        held(up, root)
        return info, True
    return tag(remote, up.publisher, name, root.hex()), False


def pin_both(up: Uploads, publisher, target: str, root: bytes | None) -> str:
    """Pin `root` as tag_both tags it: in the tier when it lists it (the remote follows),
    else at the remote -> its root hex."""
    from ..maintain.lifecycle import pin
    local = up.local
    if root is None:
        try:
            return pin(local, publisher, target)
        except RefNotFound:
            return pin(up.remote, up.publisher, target)
    if local.refs.catalog_has(root):
        out = pin(local, publisher, root.hex())
        held(up, root)
        return out
    return pin(up.remote, up.publisher, root.hex())


def unpin_both(up: Uploads, root: bytes) -> None:
    """Unpin `root` in the tier (the remote follows, best effort: unheld) or, pinned only
    at the remote, there."""
    local = up.local
    if root in local.refs.pins():
        local.refs.unpin(root)
        unheld(up, pin=root)
        return
    with _reaching(up, f"unpin {root.hex()[:16]}"):
        if root in up.remote.refs.pins():
            up.remote.refs.unpin(root)
            return
    local.refs.unpin(root)  # pinned nowhere: the table's own answer


def untag_both(up: Uploads, name: str) -> str:
    """Remove tag `name` from both tables (RefNotFound if neither has it) -> the root it
    named (the tier's where both have it)."""
    from ..maintain.lifecycle import untag
    local, remote = up.local, up.remote
    mine = local.refs.tag_get(name)
    with _reaching(up, f"untag {name!r}"):
        theirs = remote.refs.tag_get(name)
    if mine is None and theirs is None:
        raise RefNotFound(f"no tag named {name!r} in the local tier nor at {remote.url}")
    if mine is not None:
        untag(local, name)
    if theirs is not None:
        untag(remote, name)
    return (mine or theirs).hex()


def forget_both(up: Uploads, publisher, root: bytes, dry_run: bool):
    """Forget `root` in every table that lists it: each one's refusals (a ref's tip, a
    tag's target, pinned) are heard before either changes -> what it was."""
    local, remote = up.local, up.remote
    if not dry_run:  # an upload of it in flight ends first: its move would bring back the remote row
        _settle(up, {root})
    with _reaching(up, f"forget {root.hex()[:16]}"):
        there = remote.refs.catalog_has(root)
    cores = ([(local, publisher)] if local.refs.catalog_has(root) else []) + ([(remote, up.publisher)] if there
                                                                             else [])
    if not cores:
        raise RefNotFound(f"no kept snapshot {root.hex()[:16]} in the local tier nor at {remote.url}")
    info = cores[0][1].info(root)
    for core, _ in reversed(cores):  # every refusal before either table changes
        try:
            core.refs.forget(root, info.ref, dry_run=True)
        except InvalidArgument as e:
            if core is local:
                raise
            raise InvalidArgument(f"in the remote store at {remote.url}: {e} (a snapshot not uploaded yet may be "
                                  "the remote's tip: store.wait_durable() first); nothing was forgotten") from None
    if not dry_run:
        for core, _ in cores:  # the tier first: its queue then drops the snapshot rather than send it
            core.refs.forget(root, info.ref)
    return info


def delete_ref_both(up: Uploads, ref: str, expected: str | None, newest: bytes | None, *, dry_run: bool) -> dict:
    """Remove ref `ref` from both tables. `expected` (a root's hex or prefix) is judged
    against `newest`, what the Store's one resolution of `ref` named; each table's removal
    is conditional on the root it held when looked at. The tier goes first (its queue then
    drops the ref's snapshots instead of sending them); an upload of one of them already in
    flight is waited for (REMOVE_WAIT), since its move would bring the remote ref back; then
    the remote. -> as lifecycle.delete_ref, "dropped" the union of the two."""
    from ..maintain.lifecycle import delete_ref
    local, remote = up.local, up.remote
    if expected is not None:
        if not is_hex_prefix(expected):
            raise InvalidArgument(f"expected must be a root: {MIN_PREFIX} to 64 lowercase hex digits, "
                                  f"got {expected!r}")
        if newest is None or not newest.hex().startswith(expected):
            raise RefConflict(ref, expected, newest.hex() if newest is not None else None)
    mine = local.refs.get_or_none(ref)
    with _reaching(up, f"delete_ref {ref!r}"):
        theirs = remote.refs.get_or_none(ref)
        there = delete_ref(remote, ref, theirs.hex(), dry_run=True) if theirs is not None else None
    if mine is None and theirs is None:
        raise RefNotFound(f"no ref named {ref!r} in the local tier nor at {remote.url}")
    here = delete_ref(local, ref, mine.hex(), dry_run=True) if mine is not None else None
    if not dry_run:
        ours: set = set()  # the roots the tier dropped: an upload of one may move the remote ref meanwhile
        if mine is not None:
            ours = {bytes.fromhex(r) for r in here["dropped"]} | {mine}
            delete_ref(local, ref, mine.hex())
            _settle(up, ours)
        if theirs is not None or ours:  # (an upload of ours waited for above may have made it there)
            now = remote.refs.get_or_none(ref)
            if now is not None and now != theirs and now not in ours:
                raise RefConflict(ref, None if theirs is None else theirs.hex(), now.hex(), hint=f"it was moved at "
                                  f"{remote.url} meanwhile by another writer; the local tier's ref was deleted, the "
                                  "remote's is left")
            if now is not None:
                there = delete_ref(remote, ref, now.hex(), dry_run=True)
                delete_ref(remote, ref, now.hex())
    both = [d for d in (here, there) if d is not None]
    gone = list(dict.fromkeys(r for d in both for r in d["dropped"]))
    out = {"ref": ref, "root": (newest or mine or theirs).hex(), "snapshots_dropped": len(gone)}
    return {**out, "dropped": gone, "dry_run": True} if dry_run else out


def _settle(up: Uploads, roots: set) -> None:
    """Wait (up to REMOVE_WAIT) until no upload of `roots` is in flight."""
    if not up.wait_unsent(roots, REMOVE_WAIT):
        log.warning("local tier: an upload of a deleted ref's snapshot is still in flight; the remote ref is "
                    "removed all the same (if the upload lands later, `tsck delete-ref %s` removes it)",
                    up.remote.url)


def undelete_both(up: Uploads, publisher, ref: str, to: str | None):
    """Bring back ref `ref` in every table whose reflog records its removal (the remote
    first: it is the durable one) -> (SnapshotInfo, whether the tier brought it back). A
    tier that cannot bring it back whole (its copy evicted or collected) leaves it to the
    remote, with a warning: reads fall through there."""
    from ..maintain.lifecycle import undelete
    local, remote = up.local, up.remote
    with _reaching(up, f"undelete {ref!r}"):
        theirs = remote.refs.deleted_ref_root(ref) is not None and remote.refs.get_or_none(ref) is None
    mine = local.refs.deleted_ref_root(ref) is not None
    if not theirs and not mine:
        return undelete(local, publisher, ref, to), True  # its refusal, as a store without a tier says it
    info = undelete(remote, up.publisher, ref, to) if theirs else None
    if mine:
        try:
            return undelete(local, publisher, ref, to), True
        except (IntegrityError, RefNotFound) as e:
            if info is None:
                raise
            log.warning("local tier: ref %r is back at %s but not in the tier (%s); it reads from there", ref,
                        remote.url, e)
    return info, False
