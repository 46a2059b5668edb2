"""Modes of what a run writes: as a plain open() would give them (0666 and 0777 less the umask;
0644 and 0755 under the usual umask 022).

Some writers create private files: safetensors (0.8) saves through a temporary file of mode
0600, and tempfile.mkdtemp makes 0700 directories. A checkpoint or an export made that way
can be read by no one else on a shared machine, so the directories that are renamed into
place are given the usual modes first.
"""
from __future__ import annotations

import os
from pathlib import Path


def current_umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask can only
    be read by setting it, and a file another thread creates in between would get the
    temporary value)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def honour_umask(root: Path) -> None:
    """Give `root` (a directory or one file), and everything under it, the modes a plain
    open() or mkdir() would have: 0666 & ~umask for files, 0777 & ~umask for directories.
    Links are left alone."""
    mask = current_umask()
    file_mode, dir_mode = 0o666 & ~mask, 0o777 & ~mask
    root = Path(root)
    if root.is_symlink():
        return
    if not root.is_dir():
        os.chmod(root, file_mode)
        return
    os.chmod(root, dir_mode)
    for parent, dirs, files in os.walk(root):
        for name in dirs:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, dir_mode)
        for name in files:
            path = os.path.join(parent, name)
            if not os.path.islink(path):
                os.chmod(path, file_mode)
