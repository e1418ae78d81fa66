"""sha256 of context files, remembered for big ones (the wheelhouse) between runs.

Hashing a 190 MB torch wheel costs a second or more on every no-op `build`. Render links
wheelhouse files into the context (same inode), so a digest is remembered per
(device, inode, size, modification time in ns): the stat data that make-like tools and
git's index trust. A file changed in place without its mtime changing is the accepted
blind spot; --retest does not cover it, deleting the cache file does.

The digests are the store DIGESTS (store.py): one entry per stat key, holding the hex digest,
read bounded and never through a link, written atomically, the newest MAX_ENTRIES staying;
an entry that is not a digest is ignored (the file is hashed again).
"""

from __future__ import annotations

import re
from pathlib import Path

from imagefactory.files import fsutil
from imagefactory.files.store import Store

MIN_SIZE = 1 << 20  # smaller files are hashed every time: cheaper than a lookup
MAX_ENTRIES = 512
_DIGEST_RE = re.compile(r"[0-9a-f]{64}")
DIGESTS = Store("file-digests", MAX_ENTRIES, 64, suffix=".sha256")


_hash = fsutil.sha256_file


def file_digest(path: Path) -> str:
    st = path.stat()
    if st.st_size < MIN_SIZE:
        return _hash(path)
    key = DIGESTS.key(f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}")
    kept = DIGESTS.get(key)
    if kept is not None and _DIGEST_RE.fullmatch(kept):
        return kept
    digest = _hash(path)
    DIGESTS.put(key, digest)
    return digest
