"""What the first run of a bundle waits for: its kernels being compiled, said on stderr.

PoCL (the local CPU device) compiles in two stages. clBuildProgram runs the OpenCL C front end
over the whole kernels.cl (a few seconds); then the first launch of each kernel generates and
compiles its work-group function for that launch's local size (0.1-0.5 s each, serially: PoCL
holds one compiler lock per process). Both land in PoCL's kernel cache, so a later run of the
same kernels.cl on the same device loads them in well under a second. pyopencl keeps no cache
of its own for PoCL (it leaves caching to the driver); for other drivers it caches the
binaries of clBuildProgram, which then does all the compiling.

`BuildProgress` says `building N kernels for DEVICE (first run; cached in DIR)` once a build
is known to be a first one, and `built N kernels in T s` when the first step is done; nothing
when the kernels come from a cache.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Callable, Sequence

POCL_PLATFORM = "Portable Computing Language"
# a cold front end takes seconds, a cached one a fraction of one: a build still running after this
# long is a first one, even where the cache cannot be inspected
ANNOUNCE_AFTER_S = 2.0
# file times come from the kernel's coarse clock, a few ms behind time.time()
CLOCK_SLACK_S = 0.05
GENERIC_VARIANT = "0-0-0"  # PoCL's work-group function for any local size, which launches do not use


def is_pocl(device: Any) -> bool:
    return device.platform.name == POCL_PLATFORM


def pocl_cache_dir() -> str | None:
    """PoCL's kernel cache folder, as PoCL picks it; None when POCL_KERNEL_CACHE turns it off."""
    switch = os.environ.get("POCL_KERNEL_CACHE")
    if switch is not None:
        try:
            if int(switch) == 0:
                return None
        except ValueError:  # PoCL reads the value as a number: "yes" or "true" also turns it off
            return None
    if os.environ.get("POCL_CACHE_DIR"):
        return os.environ["POCL_CACHE_DIR"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "pocl", "kcache")


def pyopencl_cache_dir() -> str | None:
    """Where pyopencl caches program binaries for drivers that keep none; None when PYOPENCL_NO_CACHE is set."""
    if os.environ.get("PYOPENCL_NO_CACHE", "").lower() in ("1", "true", "yes", "on"):
        return None
    try:
        import platformdirs

        return platformdirs.user_cache_dir("pyopencl", "pyopencl")
    except ImportError:
        return None


def cache_note(device: Any) -> str:
    """Where the compiled kernels stay, for the progress line."""
    if is_pocl(device):
        folder = pocl_cache_dir()
        return f"cached in {folder}" if folder else "not cached: POCL_KERNEL_CACHE is off"
    try:
        from pyopencl.characterize import has_src_build_cache

        if has_src_build_cache(device):  # pyopencl then leaves caching to the driver (NVIDIA's)
            return "cached by the OpenCL driver"
    except ImportError:
        pass
    folder = pyopencl_cache_dir()
    return f"cached by pyopencl in {folder}" if folder else "not cached: PYOPENCL_NO_CACHE is set"


def _kernels(count: int) -> str:
    return f"{count} kernel{'' if count == 1 else 's'}"


def _program_folder(cache: str, functions: set[str], since: float) -> str | None:
    """The cache folder of the program built since `since`: PoCL touches its `last_accessed` on every
    build, cached or not. None if none or several match (another process building at the same time)."""
    found = []
    try:
        for group in os.scandir(cache):
            if not group.is_dir():
                continue
            for program in os.scandir(group.path):
                try:
                    touched = os.stat(os.path.join(program.path, "last_accessed")).st_mtime
                except OSError:
                    continue
                if touched >= since - CLOCK_SLACK_S:
                    found.append(program.path)
    except OSError:
        return None
    if len(found) > 1:  # a folder holding kernels other than ours is another program's
        found = [f for f in found if {e.name for e in os.scandir(f) if e.is_dir()} <= functions]
    return found[0] if len(found) == 1 else None


def _compiled(folder: str, function: str) -> bool:
    try:
        variants = [v for v in os.scandir(os.path.join(folder, function)) if v.name != GENERIC_VARIANT]
    except OSError:
        return False
    return any(os.path.exists(os.path.join(v.path, f"{function}.so")) for v in variants)


def pocl_uncompiled(functions: Sequence[str], since: float) -> int | None:
    """How many of `functions` PoCL still has to compile at their first launch, from its cache; None if
    the program's folder is not found there (another PoCL's layout)."""
    cache = pocl_cache_dir()
    if cache is None:
        return len(functions)
    # a file system that keeps whole seconds may date the touch before `since`
    folder = _program_folder(cache, set(functions), since) or _program_folder(cache, set(functions), int(since))
    if folder is None:
        return None
    return sum(not _compiled(folder, f) for f in functions)


class BuildProgress:
    """Reports the kernel build of one runner: `start()` before clBuildProgram, `program_built()` after it,
    `first_step_done()` after the first step (where PoCL compiles each kernel at its first launch)."""

    def __init__(self, say: Callable[[str], None] | None, device: Any, functions: Sequence[str]) -> None:
        self.say = say
        self.device = device
        self.functions = list(functions)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._announced = 0  # kernels the "building" line counted; 0 until it is said
        self._building = False
        self._pending = 0  # kernels to report as built once the first step is done
        self._started = 0.0

    def start(self) -> None:
        self._started = time.time()
        if self.say is None:
            return
        self._building = True
        self._timer = threading.Timer(ANNOUNCE_AFTER_S, self._announce_if_building)
        self._timer.daemon = True
        self._timer.start()

    def _announce_if_building(self) -> None:
        with self._lock:
            if self._building:
                self._announce(len(self.functions))

    def _announce(self, count: int) -> None:
        """Called with the lock held."""
        if self._announced or self.say is None:
            return
        self._announced = count
        total = len(self.functions)
        name = self.device.name.strip()
        note = cache_note(self.device)
        if count < total:
            self.say(f"building {count} of {_kernels(total)} for {name} (the others are {note})")
        else:
            self.say(f"building {_kernels(total)} for {name} ({'' if note.startswith('not') else 'first run; '}{note})")

    def abandon(self) -> None:
        with self._lock:
            self._building = False
        if self._timer is not None:
            self._timer.cancel()

    def program_built(self) -> None:
        if self.say is None:
            return
        self.abandon()  # the timer's work is done: from here the cache tells
        uncompiled = pocl_uncompiled(self.functions, self._started) if is_pocl(self.device) else None
        with self._lock:
            if is_pocl(self.device):
                if uncompiled is None:  # not known: only a slow build tells
                    uncompiled = len(self.functions) if self._announced else 0
                if uncompiled:
                    self._announce(uncompiled)
                self._pending = self._announced  # compiled at their first launch, in the first step
            elif self._announced:  # other drivers compile everything in clBuildProgram: done now
                self.say(f"built {_kernels(len(self.functions))} in {time.time() - self._started:.1f} s")

    def first_step_done(self) -> None:
        if self._pending and self.say is not None:
            count, self._pending = self._pending, 0
            self.say(f"built {_kernels(count)} in {time.time() - self._started:.1f} s")
