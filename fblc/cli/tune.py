"""`fblc tune MODEL --target PROFILE --device local|adb:SERIAL -o TUNED.json`: measure the candidate schedules of
MODEL's kernels on a device and write the profile with the fastest per kernel shape (fblc/tools/tune.py)."""

from __future__ import annotations

import argparse

from fblc.errors import FblcError

DEFAULT_BUDGET_S = 600.0
DEFAULT_REPEATS = 5


def add_command(commands: argparse._SubParsersAction) -> None:
    from fblc.cli.build import add_target_options
    from fblc.cli.options import add_storage_option, add_training_options

    tune = commands.add_parser(
        "tune", help="measure MODEL's candidate kernel schedules on a device; write the profile with the fastest",
        description="Compile MODEL for --target, then for each distinct kernel shape (plan.json's schedule "
                    "'shape_key') try its candidate schedules (tile rows x columns, group_size, accumulator_form, "
                    "pair_stride; at most --candidates per shape, one bundle per round) on --device, check that "
                    "each candidate's outputs equal the default's up to float reassociation, and write -o: the "
                    "target profile with the fastest schedule of each shape in its 'schedules' (source 'measured: "
                    "fblc tune DATE DEVICE'). Every later compile with --target that file uses them.")
    add_training_options(tune)
    add_target_options(tune)
    tune.add_argument("--device", default="local",
                      help="local or opencl:P:D (pyopencl here: each kernel checked in isolation), or adb:SERIAL "
                           "(a phone: the native runner times each kernel; the losses and parameters after each "
                           "run are checked) (default: local)")
    add_storage_option(tune)
    tune.add_argument("-o", "--output", required=True, metavar="TUNED.json", help="the tuned profile to write")
    tune.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S, metavar="N",
                      help=f"start no round after N seconds; the shapes keep what was measured (default: "
                           f"{DEFAULT_BUDGET_S:g})")
    tune.add_argument("--kernels", metavar="REGEX",
                      help="tune only kernels whose name (k12_Conv) or shape key (Conv/...) matches REGEX")
    tune.add_argument("--candidates", type=int, default=6, metavar="K",
                      help="candidate schedules per kernel shape, its default included (default: 6)")
    tune.add_argument("--repeats", type=int, default=DEFAULT_REPEATS,
                      help=f"timed steps per candidate bundle; each kernel keeps its fastest (default: "
                           f"{DEFAULT_REPEATS})")
    tune.add_argument("--runner", metavar="PATH",
                      help="with adb: the native runner binary (default: $FBLC_RUNNER, else the README's build "
                           "folders)")
    tune.set_defaults(run=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from fblc.cli.options import training_options
    from fblc.tools.traced_layouts import with_traced_reads
    from fblc.tools.tune import tune

    for option, value, least in (("--candidates", args.candidates, 2), ("--repeats", args.repeats, 1)):
        if value < least:
            raise FblcError(f"{option} {value} is less than {least}", f"give {option} {least} or more")
    if not args.budget_s > 0:
        raise FblcError(f"--budget-s {args.budget_s:g} is not a positive number of seconds", "give e.g. --budget-s 60")
    if args.kernels is not None:
        _check_regex(args.kernels)
    make_bench = _bench_maker(args)
    options = with_traced_reads(args.model, args.target, args.dtype, training_options(args))
    say = (lambda line: None) if args.quiet else (lambda line: print(line, flush=True))
    result = tune(args.model, options, args.target, args.dtype, make_bench, args.output, args.budget_s,
                  pattern=args.kernels, limit=args.candidates, say=say, dump_dir=args.dump_dir)
    if not args.quiet:
        tuned = [s for s in result.shapes if s.best]
        default, after = result.step_ms
        timed = (f"; the tuned kernels {sum(result.default_ms[k] for k in result.tuned_kernels):.3f} -> "
                 f"{sum(result.tuned_ms[k] for k in result.tuned_kernels):.3f} ms, all {len(result.default_ms)} "
                 f"tunable launches {default:.3f} -> {after:.3f} ms per step, default -> tuned bundle"
                 if tuned else " (every default kept)")
        print(f"tuned {len(tuned)} of {len(result.shapes)} kernel shapes on {result.device} in {result.seconds:.1f} s"
              f"{timed}; wrote {args.output} (compile with --target {args.output})")
    return 0


def _check_regex(pattern: str) -> None:
    import re

    try:
        re.compile(pattern)
    except re.error as error:
        raise FblcError(f"--kernels '{pattern}' is not a regular expression ({error})",
                        "give e.g. --kernels Conv or --kernels 'k1[0-9]_'") from None


def _bench_maker(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    """A function of the feeds that makes the bench of --device (checked now: before anything compiles)."""
    from fblc.runtime.tune import AdbBench, LocalBench

    device: str = args.device
    if device == "adb" or device.startswith("adb:"):
        if args.storage == "buffer":
            raise FblcError("--storage buffer is for a local OpenCL device: the native runner on a phone holds every "
                            "texture as an image2d_t", "drop --storage")
        from fblc.runtime.adb import Adb

        # no adb, no device, an unknown serial: the error comes before any compile
        serial = Adb().choose(device[len("adb:"):] or None)
        return lambda feeds: AdbBench(feeds, serial, args.dtype, runner=args.runner, repeats=args.repeats)
    if device != "local" and not device.startswith("opencl:"):
        raise FblcError(f"unknown --device '{device}'", "give local, opencl:P:D (see 'fblc devices') or adb:SERIAL")
    if args.runner:
        raise FblcError("--runner is the native runner of a phone (--device adb:SERIAL)", "drop --runner")
    from fblc.runtime.opencl import select_device

    select_device(None if device == "local" else device)  # an unknown opencl:P:D fails here, before compiling
    return lambda feeds: LocalBench(feeds, None if device == "local" else device, args.storage, args.repeats)


__all__ = ["add_command", "cmd_tune"]
