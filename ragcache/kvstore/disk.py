"""The ``disk`` tier: one safetensors file per entry in a folder on local SSD.

Owns: :class:`DiskTier` (file naming, atomic writes, scanning the folder). Capacity
(``ssd_cache_max_gb``), eviction order and promotion are the store's. Must not import vLLM.

Several processes may share the folder:

- writes go to a unique temporary name in the same folder and are renamed into place with
  ``os.replace`` (atomic): a reader sees the old file, the new one, or none; never a partial one;
- a reader keeps the inode it opened, so a concurrent replace or delete cannot tear its read;
  a file that vanished before it was opened is a miss;
- a hit sets the file's mtime, so the recency order survives restarts and is shared between
  processes (the store rebuilds its LRU order from mtimes at start).

Files are not fsynced: after a power loss a file may be truncated, which the header/size and
checksum checks catch (the entry is then deleted and recomputed).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from pathlib import Path
from typing import Iterable, Iterator
from urllib.parse import quote, unquote

from ragcache.kvstore.entry import StoredKV
from ragcache.kvstore.format import FileEntryReader, byte_view, encode_header
from ragcache.kvstore.tier import EntryStat, TierDefaults, get_then_delete

log = logging.getLogger(__name__)

SUFFIX = ".safetensors"
_TMP_SUFFIX = ".tmp"
_STALE_TMP_SEC = 3600.0  # temporary files older than this are leftovers of a crashed writer


def write_atomically(final: Path, parts: Iterable[bytes | memoryview]) -> None:
    """Write ``parts`` to a unique temporary file beside ``final`` (a dot file ending in ``.tmp``)
    and rename it into place: readers see the old file, the new one, or none; never a partial one.
    A folder removed meanwhile is created again.

    Raises:
        OSError: the write failed (e.g. errno ENOSPC); no temporary file is left behind.
    """
    tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex[:12]}{_TMP_SUFFIX}"
    try:
        try:
            f = open(tmp, "wb")
        except FileNotFoundError:  # folder removed under us (e.g. `cache clear` by hand)
            final.parent.mkdir(parents=True, exist_ok=True)
            f = open(tmp, "wb")
        with f:
            for part in parts:
                f.write(part)
        os.replace(tmp, final)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


class DiskTier(TierDefaults):
    """Entries as ``<quoted key>.safetensors`` files in ``root``.

    Args:
        root: the folder (created when missing).

    Raises:
        OSError: ``root`` cannot be created.
    """

    name = "disk"
    memory = False

    def __init__(self, root: os.PathLike | str) -> None:
        self.root = Path(root).expanduser()
        self.root.mkdir(parents=True, exist_ok=True)
        self._remove_stale_tmp()

    def path(self, key: str) -> Path:
        """File of ``key`` (``/`` and ``:`` are percent-encoded)."""
        return self.root / (quote(key, safe="._-@+=") + SUFFIX)

    @staticmethod
    def _key_of(filename: str) -> str | None:
        if filename.startswith(".") or not filename.endswith(SUFFIX):
            return None
        return unquote(filename[: -len(SUFFIX)])

    def _remove_stale_tmp(self) -> None:
        now = time.time()
        try:
            entries = list(os.scandir(self.root))
        except OSError:
            return
        for e in entries:
            if e.name.startswith(".") and e.name.endswith(_TMP_SUFFIX):
                try:
                    if now - e.stat().st_mtime > _STALE_TMP_SEC:
                        os.unlink(e.path)
                except OSError:
                    pass

    def scan(self) -> list[EntryStat]:
        """Every entry file with its size and mtime, oldest first (the LRU order at start).

        Raises:
            OSError: the folder cannot be listed (a missing folder is empty).
        """
        found = []
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return []
        for e in entries:
            key = self._key_of(e.name)
            if key is None:
                continue
            try:
                st = e.stat()
            except FileNotFoundError:
                continue  # deleted by another process meanwhile
            found.append(EntryStat(key, st.st_size, st.st_mtime))
        found.sort(key=lambda f: f.mtime)
        return found

    def contains(self, key: str) -> bool:
        return self.path(key).is_file()

    def open(self, key: str) -> FileEntryReader | None:
        """Reader over the file (header validated); None when the file does not exist.

        Raises:
            CorruptEntryError: bad header or wrong size (truncated).
            ForeignEntryError: a safetensors file that is not a ragcache KV entry.
            OSError: the file exists but cannot be read.
        """
        try:
            return FileEntryReader(self.path(key), key)
        except FileNotFoundError:
            return None

    def put(self, item: StoredKV) -> int:
        """Write ``item`` to a temporary file and rename it into place; return the file size.

        Raises:
            OSError: the write failed (e.g. errno ENOSPC); no partial file is left behind.
        """
        kv = item.kv.detach().cpu().contiguous()
        header = encode_header(item.key, item.meta)
        write_atomically(self.path(item.key), [header, memoryview(byte_view(kv))])
        return len(header) + item.nbytes

    def delete(self, key: str) -> bool:
        try:
            os.unlink(self.path(key))
            return True
        except FileNotFoundError:
            return False

    def pop(self, key: str) -> StoredKV | None:
        """Read the file (checksums verified), then delete it; None when there is none.

        Raises:
            CorruptEntryError / ForeignEntryError / OSError: as :meth:`open`; the file is kept.
        """
        return get_then_delete(self, key)

    def keys(self) -> Iterator[str]:
        return iter([f.key for f in self.scan()])

    def clear(self, prefix: str = "") -> None:
        """Delete every entry file whose key starts with ``prefix`` and stale temporary files
        (other files and writes in flight are left)."""
        self._remove_stale_tmp()
        try:
            entries = list(os.scandir(self.root))
        except FileNotFoundError:
            return
        for e in entries:
            key = self._key_of(e.name)
            if key is not None and key.startswith(prefix):
                try:
                    os.unlink(e.path)
                except FileNotFoundError:
                    pass

    def free_bytes(self) -> int | None:
        """Bytes the folder's filesystem has free for an unprivileged writer (``statvfs``
        ``f_bavail * f_frsize``); None when it cannot be asked."""
        try:
            st = os.statvfs(self.root)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def block_size(self) -> int:
        """The filesystem's allocation unit in bytes (a file occupies a multiple of it)."""
        try:
            return max(1, os.statvfs(self.root).f_frsize)
        except OSError:
            return 4096

    def touch(self, key: str) -> None:
        try:
            os.utime(self.path(key))
        except OSError:
            pass
