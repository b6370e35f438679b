"""Where each command writes, checked before it does any work; and saving trained parameters safely.

A command that fails at its last step (writing) after minutes of compiling or hours of
training loses that work, so every path a command will write is checked up front: the folder
it goes into exists (or can be made) and is writable, and the path is not something else (a
folder where a file goes, a file where a bundle folder goes, a folder of the user's files).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from dataclasses import dataclass
from typing import Callable, Mapping

import numpy as np

from fblc import bundle_format as fmt
from fblc.errors import FblcError


@dataclass(frozen=True)
class Output:
    option: str     # as the user types it, for the messages
    kind: str       # "file", "bundle" (a folder fblc owns) or "folder" (one fblc writes files into)
    parents: bool   # the command makes missing parent folders (compile -o a/b/bundle) rather than refusing
    example: str = ""  # a file name to suggest


DUMPS = Output("--dump-dir", "folder", True)
#: what each command writes, by argparse attribute (absent or None: not written this time)
OUTPUTS: dict[str, dict[str, Output]] = {
    "train-graph": {"output": Output("-o", "file", True, "step.onnx"), "dump_dir": DUMPS},
    "compile": {"output": Output("-o", "bundle", True), "dump_dir": DUMPS},
    "verify": {"dump_dir": DUMPS},
    "run": {"save_params": Output("--save-params", "file", False, "trained.npz"),
            "results": Output("--results", "file", False, "results.json")},
    "profile": {"output": Output("-o", "file", False, "profile.json")},
}


def params_path(path: str) -> str:
    """The file --save-params writes (numpy.savez adds .npz to a name without it)."""
    return path if path.endswith(".npz") else path + ".npz"


Problem = tuple[str, str]  # (cause naming the value, what to do): an FblcError's two halves


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


def foreign_files(bundle: str) -> list[str]:
    """Entries of the existing folder `bundle` that fblc did not write (all of them if it is no bundle)."""
    try:
        ours = {fmt.MANIFEST, *fmt.RUNTIME_FILES, *fmt.read_json(os.path.join(bundle, fmt.MANIFEST))["checksums"]}
    except (OSError, ValueError, KeyError, TypeError):
        ours = set()
    return sorted(set(os.listdir(bundle)) - ours)


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


def _problem(output: Output, path: str, force: bool) -> Problem | None:
    if output.kind == "bundle":
        found = _bundle_problem(output.option, path, force)
        if found:
            return found
    elif output.kind == "file" and os.path.isdir(path):
        return f"{output.option} '{path}' is a folder", f"give a file name, e.g. {os.path.join(path, output.example)}"
    elif output.kind == "folder" and os.path.exists(path) and not os.path.isdir(path):
        return f"{output.option} '{path}' is an existing file, not a folder", "choose a folder name"
    # a bundle or a file is written beside its final name, then renamed: its folder must take new files.
    # Folders are named as the user wrote them (relative stays relative), for the messages.
    path = os.path.normpath(path)
    folder = path if output.kind == "folder" else os.path.dirname(path) or "."
    found = _folder_problem(folder, output.parents)
    return (f"{output.option} '{path}': {found[0]}", found[1]) if found else None


def check_outputs(args: argparse.Namespace) -> None:
    """Refuse, with one FblcError naming the option, any path the command could not write at its end."""
    for attribute, output in OUTPUTS.get(getattr(args, "command", ""), {}).items():
        path = getattr(args, attribute, None)
        if not path:
            continue
        found = _problem(output, params_path(path) if attribute == "save_params" else path,
                         getattr(args, "force", False))
        if found:
            raise FblcError(*found)


def save_parameters(path: str, parameters: dict[str, np.ndarray]) -> str:
    """np.savez to `path` (.npz added if missing) atomically; returns the path written."""
    path = params_path(path)
    handle, temporary = tempfile.mkstemp(prefix=".fblc-", suffix=".npz", dir=os.path.dirname(os.path.abspath(path)))
    os.close(handle)
    try:
        np.savez(temporary, **parameters)
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.unlink(temporary)
    return path


def save_trained(path: str, parameters: Callable[[], dict[str, np.ndarray]]) -> tuple[str, str]:
    """(the file written, '' or why `path` could not be): the folder was checked before training, but it can
    still go (a removed folder, a full disk); then the parameters go to the system's temporary folder, so that
    a finished training is never lost. FblcError only when neither can be written."""
    values = parameters()
    try:
        return save_parameters(path, values), ""
    except OSError as error:
        why = f"cannot write --save-params '{path}' ({error.strerror or error})"
    stem = os.path.splitext(os.path.basename(path))[0] or "params"
    fallback = ""
    try:
        handle, fallback = tempfile.mkstemp(prefix=f"fblc-{stem}-", suffix=".npz")
        with os.fdopen(handle, "wb") as out:
            np.savez(out, **values)
    except OSError as error:
        if fallback and os.path.exists(fallback):  # half a file is no save
            os.unlink(fallback)
        raise FblcError(f"{why}, nor a fallback in {tempfile.gettempdir()} ({error.strerror or error}): the trained "
                        "parameters are lost", "free disk space or choose another --save-params folder, and train "
                        "again") from None
    return fallback, why


def report_fallback(written: str, why: str) -> None:
    """After a finished training: a fallback save is an error (the file asked for is not there), naming where
    the parameters are."""
    if why:
        raise FblcError(f"{why}; saved the trained parameters to '{written}' instead", "move that file where you "
                        "want it")


def print_step(step: int, loss: float, metrics: Mapping[str, float], ms: float, as_json: bool) -> None:
    """One line of `fblc run`'s per-step output (local and adb): JSON, or a readable row."""
    loss += 0.0  # -0.0 (a batch whose labels are all ignored) prints as 0
    if as_json:
        print(json.dumps({"step": step, "loss": loss, **metrics, "ms": round(ms, 3)}), flush=True)
        return
    shown = "".join(f"  {name} {value:.6g}" for name, value in metrics.items())  # skipped 0, scale 1024
    print(f"step {step:4d}  loss {loss:.6f}{shown}  {ms:8.1f} ms", flush=True)
