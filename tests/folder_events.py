"""Names created in or renamed into a few folders, as they happen (Linux inotify through libc): lets a
test act at the instant a run starts a checkpoint, a publication or a removal, which polling would miss."""

from __future__ import annotations

import ctypes
import os
import select
import struct
from pathlib import Path

IN_MOVED_TO = 0x80
IN_CREATE = 0x100
_HEADER = struct.Struct("iIII")  # wd, mask, cookie, len (struct inotify_event), then the name


class FolderEvents:
    def __init__(self):
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self.folders: dict[int, Path] = {}

    def watch(self, folder: Path) -> bool:
        """Start watching `folder` (once); False while it does not exist."""
        if folder in self.folders.values() or not folder.is_dir():
            return folder in self.folders.values()
        wd = self.libc.inotify_add_watch(self.fd, os.fsencode(folder), IN_CREATE | IN_MOVED_TO)
        if wd < 0:
            return False
        self.folders[wd] = folder
        return True

    def wait(self, timeout: float) -> list[Path]:
        """The paths that appeared since the last call, waiting up to `timeout` for the first."""
        if not select.select([self.fd], [], [], timeout)[0]:
            return []
        try:
            data = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return []
        paths, offset = [], 0
        while offset < len(data):
            wd, _, _, size = _HEADER.unpack_from(data, offset)
            name = data[offset + _HEADER.size: offset + _HEADER.size + size].rstrip(b"\0")
            offset += _HEADER.size + size
            if wd in self.folders:
                paths.append(self.folders[wd] / os.fsdecode(name))
        return paths

    def close(self) -> None:
        os.close(self.fd)
