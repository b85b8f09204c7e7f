"""One catalog across a local tier and its remote store (docs/design/tiers.md, "One
catalog"): a tag or pin made in the tier is made in the remote table too, so that the
remote's retention, an offline gc of the remote and a node that lost its tier keep what
the tier keeps. Functions of the Uploader `up` (its remote core, publisher and queue)."""

from __future__ import annotations

import logging

from ..errors import IntegrityError, StorageError, TsckError
from ..roles import RefNaming, UploadQueue

__all__ = ["publish_holds", "held", "unheld", "upload_hold"]

log = logging.getLogger(__name__)


def _holds(up, root: bytes) -> tuple[list[str], bool]:
    refs: UploadQueue = up.local.refs
    return [name for name, r in refs.tags() if r == root], root in refs.pins()


def publish_holds(up, root: bytes) -> None:
    """The tags and pins that name `root` in the tier, made in the remote table too
    (and a tag's storage object, which recover rebuilds it from), so that the remote's
    retention, an offline `tsck gc` of the remote and a node that lost its tier keep
    what the tier keeps. The remote must list `root` or hold all of it (a tag or pin
    there adopts it then: lifecycle.tag, lifecycle.pin). A remote tag of that name
    naming another snapshot (another tier's) is left, with a warning."""
    from ..lifecycle import pin, tag
    names, pinned = _holds(up, root)
    remote: RefNaming = up.remote.refs
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


def held(up, root: bytes) -> None:
    """A tag or pin naming `root` was just made in the tier: make it the remote's
    too. Now, when the remote catalog lists `root`; when it does not and `root` is
    queued, its upload publishes it (publish_holds runs after the remote move, which
    comes after this look); else (a snapshot the backlog rule skipped, one the remote
    retention expired, a remote away) it is queued to be sent for its holds alone,
    into the remote catalog without moving the remote ref (upload_hold)."""
    refs: UploadQueue = up.local.refs
    try:
        if up.remote.refs.catalog_has(root):
            publish_holds(up, root)
            return
    except (StorageError, TsckError, OSError) as e:
        log.warning("local tier: the tag or pin of %s could not be made at %s now (%s); the uploader makes it",
                    root.hex()[:16], up.remote.url, e)
    else:
        if any(e["root"] == root and not e.get("hold") for _, e in refs.upload_pending()):
            return
    row = refs.catalog_get(root, checked=False) or {}
    refs.upload_enqueue(root, row.get("ref"), row.get("step"), hold=True)
    up.notify()


def unheld(up, tag_name: str | None = None, pin: bytes | None = None, root: bytes | None = None) -> None:
    """A tag or pin removed in the tier: removed in the remote table too, best
    effort (left there, it keeps more than asked, never less)."""
    from ..lifecycle import untag
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


def upload_hold(up, seq: int, root: bytes, row: dict) -> None:
    """An entry queued for the tags and pins of `root` (held): the remote gets the
    snapshot into its catalog with them, and its ref does not move (a newer snapshot
    may be its tip). What the remote lacks is sent first, as for any upload; the tag
    or pin then adopts the snapshot there (every object found present, fenced on the
    remote gc epoch: a deletion phase in between is waited out and the objects are
    looked at again)."""
    refs: UploadQueue = up.local.refs
    names, pinned = _holds(up, root)
    if not names and not pinned:
        log.debug("local tier: snapshot %s was queued for a tag or pin that is gone; not sent", root.hex()[:16])
        refs.upload_drop(seq)
        return
    if not up.remote.refs.catalog_has(root) and root not in refs.evicted():
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
        if root in refs.evicted():
            # Its local copy went to the budget and the remote no longer holds all of
            # it: neither tier can keep it now; said, not retried for ever.
            log.error("local tier: snapshot %s cannot be tagged or pinned at %s: %s; its local copy was "
                      "evicted, so no tier holds it whole", root.hex()[:16], up.remote.url, e)
            refs.upload_drop(seq)
            return
        # A remote gc removed some of what was sent before the tag or pin took it in:
        # sent again on the next try.
        raise StorageError(f"snapshot {root.hex()[:16]} is not whole at {up.remote.url} yet ({e})") from e
    refs.upload_done(seq, root)
    up.notify()
    log.debug("local tier: snapshot %s (step %s) durable at %s for its %s", root.hex()[:16], row.get("step"),
              up.remote.url, "tags and pin" if names and pinned else "tags" if names else "pin")
