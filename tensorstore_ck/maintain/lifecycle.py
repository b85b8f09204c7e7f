"""Tags, pins, forgetting and deleting refs: the ref-table rows that keep or drop a
snapshot, made safely beside gc and beside failures.

A tag or pin of a snapshot is fenced against gc like a ref move (fenced): its row goes
in only while the gc deletion epoch is still the one read before the target was
resolved, so a snapshot a deletion phase is removing cannot be kept by a row that came
too late. A tag is also a storage object (tags/<hex>, created exclusively: the tag's
single source of truth across hosts, what `tsck recover` rebuilds it from); creating or
removing one rolls back its other half when the table refuses, and when the table's
answer is lost (OutcomeUnknown) keeps what the table may hold.

A deleted ref comes back by undelete (from its reflog, on the root it had), never by
a tag: refs and tags share one namespace, and a tag by a ref's name would make the
job's next put to that ref fail.

The Store's tag(), pin(), untag(), forget(), delete_ref() and undelete() call these with
its Core (and publisher).
"""

from __future__ import annotations

import time

from ..core.core import Core
from ..core.roles import RefNaming
from ..errors import (Fenced, FormatError, IntegrityError, InvalidArgument, InvalidName, OutcomeUnknown, RefConflict,
                      RefNotFound, StorageError, TsckError)
from ..format.manifest import decode_commit
from ..format.names import validate_name, validate_new_name
from ..format.tree import DIGEST_SIZE
from ..info import SnapshotInfo, row_to_info
from ..util.ids import MIN_PREFIX, Digest, is_hex_prefix
from ..write.publish import Publisher

__all__ = ["tag", "pin", "check_free", "untag", "forget", "delete_ref", "undelete", "fenced", "MAX_TAG_BYTES"]

MAX_TAG_BYTES = 120


def landed(check) -> bool:
    """After a write whose answer was lost: does the table now show it? False when
    it does not or cannot be asked."""
    try:
        return bool(check())
    except TsckError:
        return False


def _tag_in_table(core: Core, name: str, root: bytes) -> bool:
    """Whether the table holds the tag after a failed create (a lost acknowledgement
    may hide a commit); when it cannot tell, say yes: the stored tag is kept."""
    try:
        return core.refs.tag_get(name) == root
    except Exception:  # noqa: BLE001 - the table is failing: keep what is stored
        return True


def fenced(core: Core[RefNaming], publisher: Publisher, root: bytes, target: str, fence: int, make) -> None:
    """Make a tag or pin of `root` with make(fence), fenced against gc like a ref move:
    the row goes in only while the deletion epoch is still the one read before `root`
    was resolved. If a deletion phase overlapped, wait it out and go on only if the
    snapshot is still kept (catalog row, commit object); else it is gone: RefNotFound."""
    refs = core.refs
    while True:
        try:
            return make(fence)
        except Fenced:
            fence = publisher.wait_gc_idle()
            kept = refs.catalog_has(root) or root in {r for _, r in refs.list()}
            if not kept or not core.assets.has_commit(root):
                raise RefNotFound(f"snapshot {root.hex()[:16]} ({target!r}) was removed by a gc that ran "
                                  "meanwhile; nothing was created") from None


def tag(core: Core[RefNaming], publisher: Publisher, name: str, target: str) -> SnapshotInfo:
    """Create the immutable tag `name` of `target`; RefConflict if the name is taken.
    A full root (64 hex digits) that nothing keeps any more (its ref deleted, it
    forgotten) but whose commit storage still holds is adopted, when every node and
    block of it is present (as recover checks): see adopt."""
    validate_new_name(name, "tag name")
    if len(name.encode()) > MAX_TAG_BYTES:  # stored as tags/<hex>: one file name of 2x the bytes
        raise InvalidName(f"tag name is longer than {MAX_TAG_BYTES} bytes")
    refs = core.refs
    fence = publisher.fence()  # before the target is looked at (see fenced)
    try:
        root = core.resolve(target)
    except RefNotFound as e:
        root = _removed_root(core, target, e)
        check_free(refs, name)
        row = _complete_row(core, root)  # before anything is written
        return _make_tag(core, publisher, name, root, lambda: _adopt(core, publisher, name, root, row, fence))
    check_free(refs, name)
    return _make_tag(core, publisher, name, root,
                     lambda: fenced(core, publisher, root, target, fence, lambda f: refs.tag_create(name, root, fence=f)))


def check_free(refs: RefNaming, name: str, besides: bytes | None = None) -> None:
    """Before anything is written (the table checks again in its transaction:
    refs/base.py _check_tag_free): RefConflict unless `name` is free for a tag (a tag
    of that name naming `besides` counts as free: another tier's table tagging the
    same snapshot)."""
    if refs.get_or_none(name) is not None:
        raise RefConflict(name, None, refs.get_or_none(name).hex(), what="tag (a ref has this name)")
    cur = refs.tag_get(name)
    if cur is not None and (besides is None or cur != besides):
        raise RefConflict(name, None, cur.hex(), what="tag")
    gone = refs.deleted_ref_root(name)
    if gone is not None:
        raise RefConflict(name, None, gone.hex(), what="tag (a deleted ref has this name)",
                          hint=f"bring the ref back with `tsck undelete STORE {name}` (Store.undelete), or "
                               "choose another tag name")


def _removed_root(core: Core, target: str, err: RefNotFound) -> Digest:
    """The root `target` names when no ref, tag or catalog row does: a full root whose
    commit storage still holds (a snapshot removed, gc not yet run); else `err`, told
    how to name a removed snapshot."""
    if len(target) == 2 * DIGEST_SIZE and is_hex_prefix(target):
        root = Digest.parse(target)
        if core.assets.has_commit(root):
            return root
        raise RefNotFound(f"no snapshot {target[:16]} in {core.url}: nothing keeps it and storage holds no commit "
                          "of it (gc reclaimed it, or it never was)") from None
    if is_hex_prefix(target):
        raise RefNotFound(f"{err} (a snapshot removed by delete-ref or forget is named by its full root, 64 hex "
                          "digits, as they print it, until gc reclaims it)") from None
    raise err


def _complete_row(core: Core, root: Digest, verb: str = "tagged or pinned") -> dict:
    """The catalog row of the removed snapshot `root`, once every node of it verified
    and every block of it was found present (as recover adopts a commit); IntegrityError
    naming what is missing otherwise."""
    from .recover import commit_row, incomplete
    why = incomplete(core, root, set())
    if why is not None:
        raise IntegrityError(f"snapshot {root.hex()[:16]} cannot be {verb}: nothing keeps it any more and {why} "
                             "(gc has begun reclaiming it); nothing was created")
    return commit_row(decode_commit(core.assets.get_commit(root)))


def _adopt(core: Core, publisher: Publisher, name: str, root: Digest, row: dict, fence: int) -> None:
    """The tag row of a removed snapshot, with its catalog row back (RefTable.tag_adopt),
    in only while the gc epoch is still `fence`, read before the snapshot was found
    complete: no deletion phase ran in between, and every later one re-marks what tags
    and the catalog keep (gc.execute_gc) before it deletes, so it keeps the snapshot.
    A deletion phase meanwhile (Fenced) may have swept part of it: wait it out, look
    again, and go on only if it is still complete."""
    while True:
        try:
            core.refs.tag_adopt(name, root, row, fence=fence)
            return
        except Fenced:
            fence = publisher.wait_gc_idle()
            row = _complete_row(core, root)


def _make_tag(core: Core, publisher: Publisher, name: str, root: bytes, make) -> SnapshotInfo:
    """The tag's storage object, then its row (make()); either half rolled back when the
    other fails."""
    refs, assets = core.refs, core.assets
    stored = assets.put_tag(name, root, time.time())
    if stored is not None and stored != root:  # another tag by this name exists in storage
        raise RefConflict(name, None, stored.hex() if stored else None, what="tag")
    assets.sync()
    try:
        make()
    except OutcomeUnknown as e:
        # Its answer was lost: the row may be in or still landing, so the stored tag
        # stays (deleting it could leave a table tag that recover cannot rebuild).
        if landed(lambda: refs.tag_get(name) == root):
            return publisher.info(root)
        raise OutcomeUnknown(f"{e}; tag {name!r} of {root.hex()[:16]} may or may not have been created: check "
                             "`tsck tags` before creating it again", root=root, ref=name) from None
    except BaseException:
        # Ours, and the table refused it (gone snapshot, full disk): the name stays free,
        # and recover cannot bring back a tag the caller was told failed.
        if stored is None and not _tag_in_table(core, name, root):
            assets.delete_tag(name)
        raise
    try:
        return publisher.info(root)
    except StorageError:
        # The tag is made; the table went away after: describe the snapshot from its
        # commit object rather than report a failure for a tag that exists.
        c = decode_commit(assets.get_commit(root))
        return row_to_info(root, {**c, **c["stats"]})


def pin(core: Core, publisher: Publisher, target: str) -> str:
    """Pin `target` (gc keeps it whatever retention says) -> its root hex. A full root
    that nothing keeps any more but whose objects storage still holds is adopted, as
    tag() adopts one."""
    fence = publisher.fence()
    try:
        root = core.resolve(target)
    except RefNotFound as e:
        root = _removed_root(core, target, e)
        row = _complete_row(core, root)
        while True:
            try:
                core.refs.pin_adopt(root, row, fence=fence)
                return root.hex()
            except Fenced:
                fence = publisher.wait_gc_idle()
                row = _complete_row(core, root)
    try:
        fenced(core, publisher, root, target, fence, lambda f: core.refs.pin(root, fence=f))
    except OutcomeUnknown as e:
        if not landed(lambda: root in core.refs.pins()):
            raise OutcomeUnknown(f"{e}; the pin of {root.hex()[:16]} may or may not have been made",
                                 root=root) from None
    return root.hex()


def untag(core: Core, name: str) -> str:
    """Remove tag `name` (RefNotFound if there is none) -> the root it named. Its
    storage object goes first, so recover cannot bring it back after a crash here."""
    validate_name(name, "tag name")
    refs, assets = core.refs, core.assets
    root = refs.tag_get(name)
    if root is None:
        raise RefNotFound(f"no tag named {name!r}")
    saved = assets.tag_object(name)
    assets.delete_tag(name)
    assets.sync()
    try:
        refs.tag_delete(name)
    except BaseException:
        # The table kept the tag (its disk full, its server away): put its object back,
        # so the tag is whole again and recover still knows it.
        if saved is not None and _tag_in_table(core, name, root):
            assets.restore_tag(name, saved)
            assets.sync()
        raise
    return root.hex()


def forget(core: Core, publisher: Publisher, target: str, *, dry_run: bool = False) -> SnapshotInfo:
    """Drop one snapshot from the catalog (recorded in its ref's reflog) -> what it was.
    dry_run: the same checks and answer; nothing changes."""
    root = core.resolve(target)
    info = publisher.info(root)
    core.refs.forget(root, info.ref, dry_run=dry_run)
    return info


def delete_ref(core: Core, ref: str, expected: str | None, *, dry_run: bool = False) -> dict:
    """Remove ref `ref`, only if it still points where `expected` (a root's hex or prefix)
    says when given -> {"ref", "root", "snapshots_dropped"} (Store.delete_ref). dry_run:
    the same checks and answer, with "dropped" (the roots that would leave the catalog)
    and "dry_run": True; nothing changes."""
    want = None
    if expected is not None:
        if not is_hex_prefix(expected):
            raise InvalidArgument(f"expected must be a root: {MIN_PREFIX} to 64 lowercase hex digits, "
                                  f"got {expected!r}")
        actual = core.refs.get(ref)
        if not actual.hex().startswith(expected):
            raise RefConflict(ref, expected, actual.hex())
        want = actual  # the transaction deletes only if the ref still points exactly here
    if not dry_run:
        root, n = core.refs.delete_ref(ref, want)
        return {"ref": ref, "root": root.hex(), "snapshots_dropped": n}
    dropped: list = []
    root, n = core.refs.delete_ref(ref, want, dry_run=True, dropped=dropped)
    return {"ref": ref, "root": root.hex(), "snapshots_dropped": n, "dropped": [r.hex() for r in dropped],
            "dry_run": True}


def undelete(core: Core[RefNaming], publisher: Publisher, ref: str, to: str | None = None) -> SnapshotInfo:
    """Create the deleted ref `ref` again on the root it had when delete_ref removed it
    (its reflog's removal record), or on `to` (a target, or the full root of a removed
    snapshot, as tag takes) -> what it points at. Refused while the ref exists
    (RefConflict) or a tag has its name; RefNotFound if its reflog does not end with a
    removal. A snapshot nothing keeps any more is checked whole first (every node
    verified, every block present: IntegrityError naming what gc took otherwise) and
    its catalog row comes back with the ref, fenced against gc as tag() adopts one
    (_adopt). The older snapshots of its history that delete_ref dropped stay dropped."""
    refs = core.refs
    cur = refs.get_or_none(ref)
    if cur is not None:
        raise RefConflict(ref, None, cur.hex(), hint="it exists again: undelete brings back a deleted ref only "
                                                     "(a put moves a live one)")
    was = refs.deleted_ref_root(ref)
    if was is None:
        if refs.tag_get(ref) is not None:
            raise RefNotFound(f"{ref!r} is a tag, not a deleted ref")
        raise RefNotFound(f"no deleted ref named {ref!r}: its reflog records no removal (`tsck refs STORE` lists "
                          "the refs)")
    fence = publisher.fence()  # before the snapshot is looked at (see _adopt)
    if to is None:
        root = Digest(was)
    else:
        try:
            root = core.resolve(to)
        except RefNotFound as e:
            root = _removed_root(core, to, e)
    while True:
        row = _kept_row(core, root)
        if row is None:
            if not core.assets.has_commit(root):
                raise RefNotFound(f"snapshot {root.hex()[:16]} of ref {ref!r} is gone: nothing kept it and gc "
                                  "reclaimed it (storage holds no commit of it); nothing was created")
            row = _complete_row(core, root, "brought back")
        try:
            refs.undelete(ref, root, row, fence=fence)
            return publisher.info(root)
        except Fenced:
            fence = publisher.wait_gc_idle()  # a deletion phase ran: look again


def _kept_row(core: Core, root: Digest) -> dict | None:
    """The catalog row of `root` when it has one (something else keeps it: no need to
    check it whole), else None. A row that does not decode: the commit's."""
    try:
        return core.refs.catalog_get(root)
    except FormatError:
        from .recover import commit_row
        return commit_row(decode_commit(core.assets.get_commit(root)))
