"""Small helpers shared by every layer; none imports another.

    ids.py            BLAKE3-256 digests, their hex form and prefixes
    localfile.py      files outside the store's objects, whole or not at all; only
                      regular files are read
    net.py            the address other ranks reach this process at (side channels)
    paths.py          dotted paths inside a state ("model.layers.0.weight")
    progress.py       progress bars on stderr
    retry.py          the one backoff policy for transient backend failures
    units.py          sizes as shown to people: decimal SI (kB, MB, GB), one system
    writewatch.py     which pages of this process were written since last looked at (the
                      kernel's userfaultfd write-protection, read by PAGEMAP_SCAN)

Each room imports only those listed below it (pyproject.toml, import-linter).
"""
