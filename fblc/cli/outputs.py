"""Where each command writes, checked before it does any work; and saving trained parameters safely.

A command that fails at its last step (writing) after minutes of compiling or hours of
training loses that work, so every path a command will write is checked up front: the folder
it goes into exists (or can be made) and is writable, its names fit the file system, and the
path is not something else (a folder where a file goes, a file where a bundle folder goes, a
folder of the user's files), nor one of the command's inputs (OUTPUTS against INPUTS: the
--data file, the model and its external data, a file of the bundle) or another of its outputs.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError
from fblc.paths import length_problem, new_mode, shortened, write_atomically


@dataclass(frozen=True)
class Output:
    option: str     # as the user types it, for the messages
    kind: str       # "file", "bundle" (a folder fblc owns and replaces whole) or "folder" (one fblc writes files into)
    parents: bool   # the command makes missing parent folders (compile -o a/b/bundle) rather than refusing
    example: str = ""  # a file name to suggest
    written: Callable[[str], str] = lambda path: path  # the path written, from the one given
    beside: tuple[str, ...] = ()  # suffixes of files it may also write beside it (STEP.onnx.data)
    #: why this command cannot write it with these options at all (None: it can)
    refused: Callable[[argparse.Namespace], "Problem | None"] = lambda args: None


@dataclass(frozen=True)
class Input:
    name: str  # what it is, for the messages ("the model", "the --data file")
    kind: str  # "file", "model" (a file and its external data), "bundle" (a folder), "profile" (a name or .json)


Problem = tuple[str, str]  # (cause naming the value, what to do): an FblcError's two halves


def params_path(path: str) -> str:
    """The file --save-params writes (numpy.savez adds .npz to a name without it)."""
    return path if path.endswith(".npz") else path + ".npz"


def _results_refused(args: argparse.Namespace) -> Problem | None:
    device = getattr(args, "device", "local") or "local"
    if device == "adb" or device.startswith("adb:"):
        return None
    return (f"--results is the native runner's results file, written only on a phone (--device adb:SERIAL); with "
            f"--device {device} nothing would be written", "drop --results, or add --json for one JSON object per "
            "step (step, loss, ms) on stdout")


def _infer_only(args: argparse.Namespace) -> Problem | None:
    return None if getattr(args, "infer", False) else (
        "-o is where --infer writes a forward bundle's outputs; a training run writes none",
        "add --infer (a bundle compiled with --trainer none), or --save-params FILE.npz for trained parameters")


DUMPS = Output("--dump-dir", "folder", True)
#: what each command writes, by argparse attribute (absent or None: not written this time)
OUTPUTS: dict[str, dict[str, Output]] = {
    "train-graph": {"output": Output("-o", "file", True, "step.onnx", beside=(".data",)), "dump_dir": DUMPS},
    "compile": {"output": Output("-o", "bundle", True), "dump_dir": DUMPS},
    "verify": {"dump_dir": DUMPS},
    "run": {"save_params": Output("--save-params", "file", False, "trained.npz", written=params_path),
            "results": Output("--results", "file", False, "results.json", refused=_results_refused),
            "output": Output("-o", "file", False, "outputs.npz", written=params_path, refused=_infer_only)},
    "profile": {"output": Output("-o", "file", False, "profile.json")},
    "export": {"output": Output("-o", "file", True, "model.onnx", beside=(".data",)),
               "keep_adapters": Output("--keep-adapters", "file", True, "specialist.npz")},
    "tune": {"output": Output("-o", "file", False, "tuned_profile.json"), "dump_dir": DUMPS},
}
MODEL = Input("the model", "model")
TARGET = Input("the --target profile", "profile")
RUNNER = Input("the --runner binary", "file")
#: what each command reads, by argparse attribute: no output may be one of them (or replace a folder holding one)
INPUTS: dict[str, dict[str, Input]] = {
    "train-graph": {"model": MODEL},
    "compile": {"model": MODEL, "target": TARGET},
    "verify": {"model": MODEL, "target": TARGET},
    "run": {"bundle": Input("the bundle", "bundle"), "data": Input("the --data file", "file"), "runner": RUNNER},
    "profile": {"runner": RUNNER, "show": Input("the --show profile", "file")},
    "export": {"bundle": Input("the bundle", "bundle"), "params": Input("the --params file", "file"), "model": MODEL},
    "tune": {"model": MODEL, "target": TARGET, "runner": RUNNER},
}


def _folder_problem(folder: str, parents: bool) -> Problem | None:
    """Why files cannot be created in `folder`; with `parents`, in its nearest existing ancestor."""
    existing = folder
    while parents and not os.path.exists(existing) and (os.path.dirname(existing) or ".") != existing:
        existing = os.path.dirname(existing) or "."
    if not os.path.exists(existing):
        return f"folder '{folder}' does not exist", f"create it first (mkdir -p {folder}) or choose another path"
    if not os.path.isdir(existing):
        return f"'{existing}' is a file, not a folder", "choose another path"
    if not os.access(existing, os.W_OK | os.X_OK) or not _can_create_in(existing):
        return f"folder '{existing}' is not writable", "choose a folder you can write to, or fix its permissions"
    return None


def _can_create_in(folder: str) -> bool:
    """Whether an entry can be made in `folder`, by making one: access(2) answers yes to root everywhere,
    also where a mount refuses (/proc, some FUSE file systems)."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".fblc-probe-", dir=folder))
    except OSError:
        return False
    return True


def _bundle_files(bundle: str) -> set[str]:
    """The entries of a bundle folder fblc writes and reads: the manifest, the files it checksums, the runtime's."""
    try:
        return {fmt.MANIFEST, *fmt.RUNTIME_FILES, *fmt.read_json(os.path.join(bundle, fmt.MANIFEST))["checksums"]}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def foreign_files(bundle: str) -> list[str]:
    """Entries of the existing folder `bundle` that fblc did not write (all of them if it is no bundle)."""
    return sorted(set(os.listdir(bundle)) - _bundle_files(bundle))


def _bundle_problem(option: str, path: str, force: bool) -> Problem | None:
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{option} '{path}' is an existing file, not a bundle folder", "choose a new folder name for the bundle"
    if not os.path.isdir(path) or not os.listdir(path):
        return None
    others = foreign_files(path)
    shown = ", ".join(others[:5]) + (f" and {len(others) - 5} more" if len(others) > 5 else "")
    if not os.path.isfile(os.path.join(path, fmt.MANIFEST)):
        # never replaced, even with --force: it may be anyone's folder (a home directory, a data set)
        return (f"{option} '{path}' exists and is not an fblc bundle (it holds {shown})",
                f"choose another {option} folder")
    if others and not force:
        return (f"{option} '{path}' holds files fblc did not write ({shown}), and compiling replaces the whole folder",
                f"choose another {option} folder, or add --force to replace it, those files included")
    return None


def _kind_problem(output: Output, given: str, force: bool) -> Problem | None:
    """The path given is the wrong kind of thing: a folder where a file goes, a file where a folder goes."""
    if output.kind == "bundle":
        return _bundle_problem(output.option, given, force)
    written = output.written(given)
    if output.kind == "file" and (os.path.isdir(given) or os.path.isdir(written)):
        folder = given if os.path.isdir(given) else written
        return (f"{output.option} '{folder}' is a folder",
                f"give a file name, e.g. {os.path.join(folder, output.example)}")
    if output.kind == "folder" and os.path.exists(given) and not os.path.isdir(given):
        return f"{output.option} '{given}' is an existing file, not a folder", "choose a folder name"
    return None


def _length_problem(output: Output, given: str) -> Problem | None:
    """A name too long for the file system, found before any work (it would fail at the end, after it)."""
    written = output.written(given)
    for path in (written, *(written + suffix for suffix in output.beside)):
        found = length_problem(path)
        if found:
            return f"{output.option} {_shown(output, given, path)}: {found[0]}", found[1]
    return None


def _problem(output: Output, given: str, force: bool) -> Problem | None:
    found = _length_problem(output, given) or _kind_problem(output, given, force)
    if found:
        return found
    # a bundle or a file is written beside its final name, then renamed: its folder must take new files.
    # Folders are named as the user wrote them (relative stays relative), for the messages.
    path = os.path.normpath(output.written(given))
    folder = path if output.kind == "folder" else os.path.dirname(path) or "."
    found = _folder_problem(folder, output.parents)
    return (f"{output.option} '{path}': {found[0]}", found[1]) if found else None


# --- no output may be an input ------------------------------------------------------------------------------
Read = tuple[str, str]  # (what it is, for the messages; a path the command reads)
#: the largest model file whose external data files are listed (a model with external data keeps its weights
#: out of the file, so its file is small; a larger one is not parsed twice for this)
EXTERNAL_SCAN_BYTES = 64 << 20


def _file_reads(name: str, path: str) -> list[Read]:
    return [(f"{name} '{path}'", path)] if os.path.isfile(path) else []


def _model_reads(name: str, path: str) -> list[Read]:
    reads = _file_reads(name, path)
    if reads and os.path.getsize(path) <= EXTERNAL_SCAN_BYTES:
        from fblc.compiler.model_io import external_data_files

        reads += [(f"the external data file '{data}' of {name} '{path}'", data) for data in external_data_files(path)]
    return reads


def _bundle_reads(name: str, path: str) -> list[Read]:
    entries = sorted(_bundle_files(path)) if os.path.isdir(path) else []
    return [(f"{name} '{path}' (its {entry})", os.path.join(path, entry)) for entry in entries
            if os.path.isfile(os.path.join(path, entry))]


#: the files each kind of input consists of
READS: dict[str, Callable[[str, str], list[Read]]] = {
    "file": _file_reads, "model": _model_reads, "bundle": _bundle_reads,
    # a shipped target's name is no path; a .json is
    "profile": lambda name, path: _file_reads(name, path) if path.endswith(".json") else [],
}


def _same(path: str, other: str) -> bool:
    """Whether the two name one file: the same real path, or hard links to one."""
    if os.path.realpath(path) == os.path.realpath(other):
        return True
    return os.path.exists(path) and os.path.exists(other) and os.path.samefile(path, other)


def _inside(path: str, folder: str) -> bool:
    real, container = os.path.realpath(path), os.path.realpath(folder)
    return real == container or real.startswith(container.rstrip(os.sep) + os.sep)


def _shown(output: Output, given: str, path: str) -> str:
    """The output as the user gave it, and the file `path` it writes where that is another name (a name too
    long to show whole shortened)."""
    shown = f"'{shortened(given, 120)}'"
    if path == given:
        return shown
    if path == output.written(given):
        return f"{shown} (written as '{shortened(path, 120)}')"
    return f"{shown} (which may also write '{shortened(os.path.basename(path))}' beside it)"


def _clash(output: Output, given: str, reads: Callable[[], list[Read]],
           claimed: list[tuple[Output, str]]) -> Problem | None:
    """`output` would overwrite or remove a file the command reads, or another of its outputs."""
    written = output.written(given)
    names = (written, *(written + suffix for suffix in output.beside))
    # only a path that exists can be an input: a new one costs no look at the inputs (a model's external data)
    for what, path in reads() if any(os.path.exists(name) for name in names) else []:
        for name in names if output.kind == "file" else ():
            if _same(name, path):
                return (f"{output.option} {_shown(output, given, name)} is {what}, which this command reads: "
                        "writing it would overwrite that input", f"choose another {output.option} file")
        if output.kind == "bundle" and _inside(path, written):
            return (f"{output.option} '{given}' holds {what}, and writing the bundle replaces the whole folder",
                    f"choose another {output.option} folder, or move that input out of it")
    for other, other_given in claimed:
        other_written = other.written(other_given)
        if output.kind == other.kind == "file" and _same(written, other_written):
            return (f"{output.option} {_shown(output, given, written)} is also {other.option} '{other_given}'",
                    "give each output its own file")
        for outer, outer_path, inner, inner_path in ((other, other_written, output, written),
                                                     (output, written, other, other_written)):
            if outer.kind == "bundle" and _inside(inner_path, outer_path):
                return (f"{inner.option} '{inner_path}' is inside the bundle folder {outer.option} '{outer_path}', "
                        "which writing the bundle replaces whole", f"choose a {inner.option} outside it")
    return None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, with one FblcError naming the option, any path the command could not write at its end, or
    whose writing would destroy one of its inputs or another of its outputs."""
    command = getattr(args, "command", "")

    @functools.cache
    def reads() -> list[Read]:
        return [read for attribute, source in INPUTS.get(command, {}).items() if getattr(args, attribute, None)
                for read in READS[source.kind](source.name, getattr(args, attribute))]

    claimed: list[tuple[Output, str]] = []
    for attribute, output in OUTPUTS.get(command, {}).items():
        given = getattr(args, attribute, None)
        if not given:
            continue
        found = (output.refused(args) or _problem(output, given, getattr(args, "force", False))
                 or _clash(output, given, reads, claimed))
        if found:
            raise FblcError(*found)
        claimed.append((output, given))


# --- saving trained parameters ------------------------------------------------------------------------------
def save_parameters(path: str, parameters: dict[str, np.ndarray]) -> str:
    """np.savez to `path` (.npz added if missing) atomically; returns the path written."""
    path = params_path(path)
    write_atomically(path, lambda out: np.savez(out, **parameters))
    return path


#: characters of --save-params's name kept in the fallback's (the name itself may be what failed: too long)
FALLBACK_STEM = 40


def save_trained(path: str, parameters: Callable[[], dict[str, np.ndarray]]) -> tuple[str, str]:
    """(the file written, '' or why `path` could not be): the folder was checked before training, but it can
    still go (a removed folder, a full disk); then the parameters go to the system's temporary folder, so that
    a finished training is never lost. FblcError only when neither can be written."""
    values = parameters()
    try:
        return save_parameters(path, values), ""
    except OSError as error:
        why = f"cannot write --save-params '{path}' ({error.strerror or error})"
    stem = os.path.splitext(os.path.basename(path))[0][:FALLBACK_STEM] or "params"
    fallback = ""
    try:
        handle, fallback = tempfile.mkstemp(prefix=f"fblc-{stem}-", suffix=".npz")
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **values)
        os.chmod(fallback, new_mode())
    except OSError as error:
        if fallback and os.path.exists(fallback):  # half a file is no save
            os.unlink(fallback)
        raise FblcError(f"{why}, nor a fallback in {tempfile.gettempdir()} ({error.strerror or error}): the trained "
                        "parameters are lost", "free disk space or choose another --save-params folder, and train "
                        "again") from None
    return fallback, why


def _size(nbytes: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def report_fallback(written: str, why: str) -> None:
    """After a finished training: a fallback save is an error (the file asked for is not there), naming where
    the parameters are."""
    if why:
        raise FblcError(f"{why}; saved the trained parameters to '{written}' instead", "move that file where you "
                        "want it")


def report_saved(written: str, why: str, asked: str, count: int, quiet: bool, as_json: bool = False) -> None:
    """After a finished training of `count` parameters: report_fallback; else, unless `quiet`, what was written
    where (on stderr under --json, whose stdout holds only the steps)."""
    report_fallback(written, why)
    if quiet:
        return
    added = f" (.npz added to --save-params '{asked}')" if written != asked else ""
    print(f"saved {count} trained parameter{'s' if count != 1 else ''} ({_size(os.path.getsize(written))}) to "
          f"'{written}'{added}", file=sys.stderr if as_json else sys.stdout, flush=True)


def print_step(step: int, loss: float, metrics: Mapping[str, float], ms: float, as_json: bool) -> None:
    """One line of `fblc run`'s per-step output (local and adb): JSON, or a readable row."""
    loss += 0.0  # -0.0 (a batch whose labels are all ignored) prints as 0
    if as_json:
        print(json.dumps({"step": step, "loss": loss, **metrics, "ms": round(ms, 3)}), flush=True)
        return
    shown = "".join(f"  {name} {value:.6g}" for name, value in metrics.items())  # skipped 0, scale 1024
    print(f"step {step:4d}  loss {loss:.6f}{shown}  {ms:8.1f} ms", flush=True)
