"""A local tier in front of a remote store (docs/design/tiers.md): open_store(remote,
local=PATH) publishes on a local disk and a background uploader makes each snapshot
durable in the remote store.

    opening.py   the tier's Core and the Store over it, the remote opened on first use
"""
