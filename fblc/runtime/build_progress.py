"""What the first run of a bundle waits for: its kernels being compiled, said on stderr.

PoCL (the local CPU device) compiles in two stages. clBuildProgram runs the OpenCL C front end
over the whole kernel source (a few seconds); then the first launch of each kernel generates and
compiles its work-group function for that launch's local size (0.1-0.5 s each, serially: PoCL
holds one compiler lock per process). Both land in PoCL's kernel cache, so a later run of the
same kernel source on the same device loads them in well under a second. pyopencl keeps no cache
of its own for PoCL (it leaves caching to the driver); for other drivers it caches the
binaries of clBuildProgram, which then does all the compiling.

`BuildProgress` says `building N distinct kernels for DEVICE (first run; cached in DIR)` once a
build is known to be a first one (N counts kernel functions: a bundle launches some of them more
than once; `fblc compile` says how many launches), then, from a thread, every PROGRESS_EVERY_S
while the build lasts: `  still building (T s)` inside clBuildProgram (one call, nothing to
count), and `  built K of N (T s)` during the first step, K read from PoCL's cache, which gains
each kernel's work-group function as the step launches it (T-ResNet's first step is 15-30 s of
these; a line only when K moved). `built N distinct kernels in T s` closes it when the first step
is done; nothing is said when the kernels come from a cache. The thread can speak during the
step because LocalRunner waits for the launches in queue.finish(), which releases the GIL (a
blocking read holds it: before, the first step was 20 s of silence).
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Any, Callable, Sequence

POCL_PLATFORM = "Portable Computing Language"
# a cold front end takes seconds, a cached one a fraction of one: a build still running after this
# long is a first one, even where the cache cannot be inspected
ANNOUNCE_AFTER_S = 2.0
# file times come from the kernel's coarse clock, a few ms behind time.time()
CLOCK_SLACK_S = 0.05
GENERIC_VARIANT = "0-0-0"  # PoCL's work-group function for any local size, which launches do not use
# a line of progress this often while kernels compile: a long build keeps saying that it moves
PROGRESS_EVERY_S = 5.0


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


def cache_note(device: Any, pyopencl_cache: bool = True) -> str:
    """Where the compiled kernels stay, for the progress line (`pyopencl_cache` False: the runner builds outside it)."""
    if is_pocl(device):
        folder = pocl_cache_dir()
        return f"cached in {folder}" if folder else "not cached: POCL_KERNEL_CACHE is off"
    try:
        from pyopencl.characterize import has_src_build_cache

        if has_src_build_cache(device):  # pyopencl then leaves caching to the driver (NVIDIA's)
            return "cached by the OpenCL driver"
    except ImportError:
        pass
    if not pyopencl_cache:
        return "not cached: built outside pyopencl's cache"
    folder = pyopencl_cache_dir()
    return f"cached by pyopencl in {folder}" if folder else "not cached: PYOPENCL_NO_CACHE is set"


def _kernels(count: int) -> str:
    return "1 kernel" if count == 1 else f"{count} distinct kernels"


def _touched_since(cache: str, since: float) -> list[str]:
    """The program folders whose `last_accessed` PoCL touched since `since`: it does on every build, cached or not."""
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
        return []
    return found


def _kernel_folders(program: str) -> set[str]:
    try:
        return {entry.name for entry in os.scandir(program) if entry.is_dir()}
    except OSError:
        return set()


def _compiled(folder: str, function: str) -> bool:
    try:
        variants = [v for v in os.scandir(os.path.join(folder, function)) if v.name != GENERIC_VARIANT]
    except OSError:
        return False
    return any(os.path.exists(os.path.join(v.path, f"{function}.so")) for v in variants)


#: pocl_program_folder's answer for a program that PoCL has compiled none of the kernels of yet
FRESH = ""


def pocl_program_folder(functions: Sequence[str], since: float) -> str | None:
    """The cache folder of the program of `functions` that PoCL built since `since`, or FRESH: programs were
    built since, none holding any of these kernels (ours is new: its folder gains a kernel's folder at that
    kernel's first launch). None when the cache is off or does not tell: no program touched since (another
    PoCL's layout), or several holding these kernels (another process building the same bundle)."""
    cache = pocl_cache_dir()
    if cache is None:
        return None
    # a file system that keeps whole seconds may date the touch before `since`
    touched = _touched_since(cache, since) or _touched_since(cache, int(since))
    if not touched:
        return None
    # the others built meanwhile (fblc's device probe, another process) hold none of these kernels, or others too
    wanted = set(functions)
    ours = [folder for folder in touched if _kernel_folders(folder) & wanted]
    if not ours:
        return FRESH
    if len(ours) > 1:
        ours = [folder for folder in ours if _kernel_folders(folder) <= wanted]
    return ours[0] if len(ours) == 1 else None


class _Count:
    """What a progress line says: the time since the build started and, once `counting`, how many of the
    kernels the first step compiles at their first launch PoCL's cache holds. It holds no runner, so a
    runner dropped unstepped takes its ticker with it (BuildProgress's finalizer)."""

    def __init__(self, functions: Sequence[str]) -> None:
        self.functions = functions
        self.started = 0.0
        self.counting = False
        self.folder = FRESH  # the program's cache folder, FRESH until PoCL creates it
        self.compiling: list[str] = []
        self._last = -1

    def line(self) -> str | None:
        elapsed = f"{int(time.time() - self.started)} s"
        if not self.counting:  # inside clBuildProgram: one call, nothing to count
            return f"  still building ({elapsed})"
        if self.folder == FRESH:
            self.folder = pocl_program_folder(self.functions, self.started) or FRESH
            if self.folder == FRESH:
                return None
        done = sum(_compiled(self.folder, f) for f in self.compiling)
        if done == self._last:  # nothing new: a runner built and not stepped says nothing more
            return None
        self._last = done
        return f"  built {done} of {len(self.compiling)} ({elapsed})"


class _Ticker:
    """A thread that says `count.line()` every PROGRESS_EVERY_S until stopped."""

    def __init__(self, say: Callable[[str], None], lock: threading.Lock, count: _Count) -> None:
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(say, lock, count), daemon=True,
                                        name="fblc-build-progress")
        self._thread.start()

    def _run(self, say: Callable[[str], None], lock: threading.Lock, count: _Count) -> None:
        while not self._stopped.wait(PROGRESS_EVERY_S):
            line = count.line()
            with lock:
                if line is not None and not self._stopped.is_set():
                    say(line)

    def stop(self, wait: bool = True) -> None:
        self._stopped.set()
        if wait and self._thread is not threading.current_thread():
            self._thread.join()  # a line it is saying comes before the caller's next one


class BuildProgress:
    """Reports the kernel build of one runner: `start()` before clBuildProgram, `program_built()` after it,
    `first_step_done()` after the first step (where PoCL compiles each kernel at its first launch)."""

    def __init__(self, say: Callable[[str], None] | None, device: Any, functions: Sequence[str],
                 pyopencl_cache: bool = True) -> None:
        self.say = say
        self.device = device
        self.pyopencl_cache = pyopencl_cache
        self.functions = list(functions)
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None
        self._ticker: _Ticker | None = None
        self._count = _Count(self.functions)
        self._announced = 0  # kernels the "building" line counted; 0 until it is said
        self._building = False
        self._pending = 0  # kernels to report as built once the first step is done
        self._started = 0.0

    def start(self) -> None:
        self._started = self._count.started = time.time()
        if self.say is None:
            return
        self._building = True
        self._timer = threading.Timer(ANNOUNCE_AFTER_S, self._announce_if_building)
        self._timer.daemon = True
        self._timer.start()

    def _announce_if_building(self) -> None:
        with self._lock:
            if self._building:
                self._announce(len(self.functions), tick=True)

    def _announce(self, count: int, tick: bool) -> None:
        """Called with the lock held; `tick`: progress lines follow until the build is done."""
        if self._announced or self.say is None:
            return
        self._announced = count
        total = len(self.functions)
        name = self.device.name.strip()
        note = cache_note(self.device, self.pyopencl_cache)
        if count < total:
            self.say(f"building {count} of {_kernels(total)} for {name} (the others are {note})")
        else:
            self.say(f"building {_kernels(total)} for {name} ({'' if note.startswith('not') else 'first run; '}{note})")
        if tick:
            self._ticker = _Ticker(self.say, self._lock, self._count)
            weakref.finalize(self, self._ticker.stop, False)

    def _stop_ticking(self) -> None:
        if self._ticker is not None:
            self._ticker.stop()
            self._ticker = None

    def _stop_timer(self) -> None:
        with self._lock:
            self._building = False
        if self._timer is not None:
            self._timer.cancel()

    def abandon(self) -> None:
        self._stop_timer()
        self._stop_ticking()

    def program_built(self) -> None:
        if self.say is None:
            return
        self._stop_timer()  # the timer's work is done: from here the cache tells
        pocl = is_pocl(self.device)
        folder = pocl_program_folder(self.functions, self._started) if pocl else None
        if folder is None:
            self._stop_ticking()  # clBuildProgram's elapsed time ends here; nothing counts the first launches
        uncompiled = 0
        with self._lock:
            if folder is not None:
                # the ticker, running or to come, now counts the kernels the first step compiles
                self._count.compiling = [f for f in self.functions if not (folder and _compiled(folder, f))]
                self._count.folder, self._count.counting = folder, True
                uncompiled = len(self._count.compiling)
            elif pocl:  # the cache off: every run compiles; another layout: only a slow build tells
                uncompiled = len(self.functions) if self._announced or pocl_cache_dir() is None else 0
            if pocl:
                if uncompiled:
                    self._announce(uncompiled, tick=folder is not None)
                self._pending = self._announced  # compiled at their first launch, in the first step
            elif self._announced:  # other drivers compile everything in clBuildProgram: done now
                self.say(f"built {_kernels(len(self.functions))} in {time.time() - self._started:.1f} s")
        if not self._pending or (folder is not None and not self._count.compiling):
            self._stop_ticking()  # everything came from the cache

    def first_step_done(self) -> None:
        self._stop_ticking()
        if self._pending and self.say is not None:
            count, self._pending = self._pending, 0
            self.say(f"built {_kernels(count)} in {time.time() - self._started:.1f} s")
