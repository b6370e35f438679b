"""Creating files and folders as the user expects: names within the file system's limits (checked before any
work), modes from the user's umask, parent folders that a failed write made removed again, and a failed
write as one FblcError that says why in words (a name too long is not a full disk).

At the bottom of the imports, with fblc.errors: the CLI, the compiler and codegen all write files.
"""

from __future__ import annotations

import codecs
import contextlib
import errno
import io
import os
import stat
import sys
import tempfile
from typing import BinaryIO, Callable, Iterator

from fblc.errors import FblcError

#: bytes a path fblc writes may exceed the one given: the temporary names beside it (.fblc-XXXXXXXX.npz,
#: .fblc-bundle-XXXXXXXX) and a bundle's files inside its staging folder (memory_timeline.png)
ROOM = 64
#: POSIX's defaults, where pathconf cannot tell
DEFAULT_LIMITS = {"PC_NAME_MAX": 255, "PC_PATH_MAX": 4096}


def nearest_existing(folder: str) -> str:
    """`folder`, or its nearest ancestor that exists."""
    folder = os.path.abspath(folder)
    while not os.path.exists(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)
    return folder


def _limit(folder: str, name: str) -> int:
    try:
        return int(os.pathconf(folder, name))
    except (OSError, ValueError):
        return DEFAULT_LIMITS[name]


def shortened(text: str, keep: int = 48) -> str:
    """`text` with its middle left out past `keep` characters: a name too long to show whole, in a message."""
    return text if len(text) <= keep else f"{text[:keep * 2 // 3]}...{text[-keep // 3:]}"


def length_problem(path: str) -> tuple[str, str] | None:
    """Why `path` cannot be created for its length, and what to do: a name to be made over the file system's
    NAME_MAX, or the whole path (absolute, with ROOM for fblc's temporary names) over PATH_MAX. None if it can."""
    absolute = os.path.abspath(path)
    existing = nearest_existing(os.path.dirname(absolute))
    name_max = _limit(existing, "PC_NAME_MAX")
    below = os.path.relpath(absolute, existing) if absolute != existing else ""
    for name in below.split(os.sep) if below and below != "." else []:
        size = len(os.fsencode(name))
        if size > name_max:
            return (f"the name '{shortened(name)}' is {size} bytes long, over the file system's limit of {name_max} "
                    "bytes per name", "choose a shorter name")
    path_max = _limit(existing, "PC_PATH_MAX")
    size = len(os.fsencode(absolute))
    if size + ROOM >= path_max:
        return (f"the path is {size} bytes long (absolute), over the system's limit of {path_max - 1 - ROOM} bytes "
                f"for a path fblc writes ({path_max - 1} less {ROOM} for its temporary names)",
                "choose a shorter path, or a folder nearer the root")
    return None


#: what to do about a failed write, by errno (the cause gives the system's words, or length_problem's)
WRITE_REMEDIES = {
    errno.ENOSPC: "free disk space, or choose a folder on another disk",
    errno.EDQUOT: "free space within your disk quota, or choose a folder on another disk",
    errno.ENAMETOOLONG: "choose a shorter name",
    errno.EACCES: "choose a folder you can write to, or fix its permissions",
    errno.EPERM: "choose a folder you can write to, or fix its permissions",
    errno.EROFS: "choose a folder on a writable file system",
}


def write_error(what: str, path: str, error: OSError) -> FblcError:
    """A failed write of `what` (e.g. "-o", "the bundle") to `path` as one line: the cause and what to do."""
    too_long = length_problem(path) if error.errno == errno.ENAMETOOLONG else None
    reason = too_long[0] if too_long else error.strerror or str(error)
    return FblcError(f"cannot write {what} '{shortened(path, 120)}' ({reason}); nothing was written",
                     WRITE_REMEDIES.get(error.errno or 0, "choose another path"))


@contextlib.contextmanager
def parents_made(folder: str) -> Iterator[None]:
    """Make `folder` and its missing parents; if the block (or the making) fails, remove the ones made here,
    so that a failed write leaves no empty folders behind."""
    missing: list[str] = []
    current = os.path.abspath(folder)
    while not os.path.isdir(current) and os.path.dirname(current) != current:
        missing.append(current)
        current = os.path.dirname(current)
    made: list[str] = []
    try:
        for path in reversed(missing):
            os.mkdir(path)
            made.append(path)
        yield
    except BaseException:
        for path in reversed(made):
            try:
                os.rmdir(path)  # only empty: whatever another program put there stays
            except OSError:
                break
        raise


def umask() -> int:
    """The process's umask, read without changing it where the system says it (Linux), else set and reset."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def new_mode(folder: bool = False) -> int:
    """The mode open() or mkdir() gives a new file or folder: 0666 or 0777 less the umask."""
    return (0o777 if folder else 0o666) & ~umask()


def mode_for(path: str, folder: bool = False) -> int:
    """The mode of the file or folder `path` replaces, else new_mode: what a file made by mkstemp or mkdtemp
    (0600, 0700) gets before it is renamed into place, so that fblc's outputs are made as any program's."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return new_mode(folder)


def write_atomically(path: str, write: Callable[[BinaryIO], None]) -> None:
    """Write `path` through a temporary file beside it, renamed into place once complete: a failure leaves the
    previous file, or nothing. The file gets the mode of the one it replaces, else the umask's (not mkstemp's
    0600)."""
    handle, temporary = tempfile.mkstemp(prefix=".fblc-", suffix=os.path.splitext(path)[1],
                                         dir=os.path.dirname(os.path.abspath(path)))
    try:
        with os.fdopen(handle, "wb") as out:
            write(out)
        os.chmod(temporary, mode_for(path))
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)


def _escape_undecodable(error: UnicodeError) -> tuple[str, int]:
    """Print a byte of a file name that is no UTF-8 (argv hands it over as a surrogate, U+DC80 to U+DCFF:
    os.fsdecode) as \\xNN, as `ls -b` shows it; any other character the stream cannot encode as \\uNNNN."""
    if not isinstance(error, UnicodeEncodeError):
        raise error
    text = error.object[error.start:error.end]
    return "".join(f"\\x{ord(c) - 0xDC00:02x}" if 0xDC80 <= ord(c) <= 0xDCFF else
                   c.encode("ascii", "backslashreplace").decode("ascii") for c in text), error.end


codecs.register_error("fblc-names", _escape_undecodable)


def escape_undecodable_names() -> None:
    """Let stdout and stderr print any file name: under a UTF-8 locale a name that is no UTF-8 would
    otherwise fail every message that shows it (UnicodeEncodeError)."""
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper):
            stream.reconfigure(errors="fblc-names")
