"""The `fblc` command line: subcommands over the compiler (and, as they land, the runtimes).

User errors print one line, `fblc: error: <cause>; <what to do>`, and exit 2; `--debug`
shows the traceback instead. Option values and the paths a command writes are checked before
the command starts (options.check_values, outputs.check_outputs), so a bad one costs no work.

Building the parser imports no compiler, runtime or numpy (the choices are fblc.choices'
tables; a command's module loads when it runs): `fblc --help` and an argument error answer in a
tenth of a second, where importing onnx alone took 1.5 s (benchmarks/cli_startup.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib
import sys
import traceback
from typing import Callable, Sequence

from fblc import __version__
from fblc.cli.build import add_target_options, cmd_compile, cmd_train_graph, cmd_verify
from fblc.cli.check import add_command as add_check_command
from fblc.cli.export import add_command as add_export_command
from fblc.cli.fleet import add_command as add_fleet_command
from fblc.cli.options import add_storage_option, add_training_options, check_values
from fblc.paths import escape_undecodable_names
from fblc.cli.profiles import add_commands as add_profile_commands
from fblc.cli.tune import add_command as add_tune_command
from fblc.errors import BundleError, FblcError

Command = Callable[[argparse.Namespace], int]


def deferred(module: str, function: str) -> Command:
    """`module.function` as a command, imported when it runs: fblc.cli.train imports numpy and the
    bundle format, which `--help` and an argument error never need."""
    def run(args: argparse.Namespace) -> int:
        return getattr(importlib.import_module(module), function)(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fblc", description="fblc: a training compiler for mobile GPUs. ONNX model in, training step out.",
        epilog="Run 'fblc COMMAND --help' for a command's options.")
    parser.add_argument("--version", action="version", version=f"fblc {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    train_graph = commands.add_parser(
        "train-graph", help="write one training step (forward, loss, backward, optimizer) as a standalone ONNX model",
        description="Build one training step of MODEL as an ONNX model that onnxruntime runs. Inputs: the model's "
                    "inputs, labels, then every trainable parameter and optimizer state (optional inputs that "
                    "default to their current values). Outputs: loss, then P.grad and P.new per parameter, then "
                    "S.new per state.")
    add_training_options(train_graph)
    train_graph.add_argument("-o", "--output", required=True, metavar="STEP.onnx", help="where to write the step")
    train_graph.add_argument("--plain-state-inputs", action="store_true",
                             help="write parameters and optimizer state as plain tensor inputs, each also an "
                                  "initializer of the same name holding its current value (ONNX's input default, "
                                  "which onnxruntime warns about once per tensor), for importers without optional "
                                  "types (TVM's)")
    train_graph.set_defaults(run=cmd_train_graph)

    compile_ = commands.add_parser(
        "compile", help="compile MODEL's training step into a bundle of OpenCL kernels for a target GPU",
        description="Build MODEL's training step, fuse it into OpenCL image2d_t kernels for --target and write a "
                    "bundle folder (manifest.json, plan.json, kernels.cl, kernels.buffer.cl, params.bin, report.json).")
    add_training_options(compile_)
    add_target_options(compile_)
    compile_.add_argument("-o", "--output", required=True, metavar="OUT", help="bundle folder to write")
    compile_.add_argument("--force", action="store_true",
                          help="replace an existing bundle OUT even if it holds files fblc did not write")
    compile_.add_argument("--report", action="store_true", help="print the layout report: data movement before and after remapping, tiles chosen")
    compile_.add_argument("--cache-report", action="store_true",
                          help="simulate the target's texture cache over every kernel's reads (runs the kernels "
                               "traced on the local OpenCL device once; report.json 'cache')")
    compile_.add_argument("--schedules", metavar="FILE",
                          help="JSON object of kernel name (k3_Gemm) or kernel shape key (plan.json's 'shape_key', "
                               "e.g. Gemm/0123456789abcdef: every kernel of that shape) -> schedule fields to override "
                               "(tile_rows, tile_columns, group_size, accumulator_form, pair_stride), over the target "
                               "profile's 'schedules' (which 'fblc tune' writes); plan.json records every kernel's "
                               "schedule (its launches' 'schedule')")
    compile_.set_defaults(run=cmd_compile)

    run = commands.add_parser(
        "run", help="train with a bundle on an OpenCL device (or run a forward bundle: --infer)",
        description="Run N training steps of BUNDLE on an OpenCL device, on batches from an .npz data file; with "
                    "--infer, run a forward bundle (--trainer none) on them and write the model's outputs.")
    run.add_argument("bundle", help="bundle folder from 'fblc compile'")
    run.add_argument("--device", default="local",
                     help="local (first OpenCL device with images; PoCL by default), opencl:P:D (see 'fblc devices'), "
                          "or adb:SERIAL (a phone: pushes the bundle and the native runner if needed, runs it in adb "
                          "shell); FBLC_OPENCL_DEVICE sets the default")
    add_storage_option(run)
    run.add_argument("--steps", type=int, default=10, help="training steps (default: 10)")
    run.add_argument("--data", required=True, metavar="FILE.npz",
                     help="one array per model input and 'labels'; more rows than the batch: iterated over batches")
    run.add_argument("--save-params", metavar="FILE.npz", help="write the trained parameters (ONNX names and shapes)")
    run.add_argument("--json", action="store_true", help="one JSON object per step: step, loss, ms")
    run.add_argument("--runner", metavar="PATH",
                     help="with adb: the native runner binary for the phone (default: $FBLC_RUNNER, else the README's "
                          "build folders)")
    run.add_argument("--kernel-times", action="store_true",
                     help="with adb: time each kernel on the device (a profiling queue, which slows some drivers)")
    run.add_argument("--results", metavar="FILE.json",
                     help="with adb: write the runner's results (losses, step and per-kernel times, bytes allocated)")
    run.add_argument("--infer", action="store_true",
                     help="run a forward bundle ('fblc compile --trainer none') once per batch of --data (the model's "
                          "inputs only) and write the model's outputs to -o (on a local device or, with the native "
                          "runner, adb:SERIAL)")
    run.add_argument("-o", "--output", metavar="OUTPUTS.npz",
                     help="with --infer: the outputs, one array per model output, batches joined along axis 0")
    run.add_argument("--specialist", metavar="FILE.npz",
                     help="with --infer, a forward bundle compiled with --adapter: load these adapter tensors (the "
                          "file 'fblc export --keep-adapters' wrote) before the first batch; only they are uploaded, "
                          "the weights stay shared (default: the adapter's identity, the base model)")
    run.set_defaults(run=deferred("fblc.cli.train", "cmd_run"))
    add_export_command(commands)
    add_fleet_command(commands)

    push = commands.add_parser(
        "push", help="copy a bundle and the native runner to a phone with adb",
        description="adb push BUNDLE and the native runner to /data/local/tmp/fblc/<bundle name> on the device "
                    "(atomically: a failed push leaves the previous copy or nothing). 'fblc run --device adb:S' "
                    "pushes by itself when the device's copy is missing or stale.")
    push.add_argument("bundle", help="bundle folder from 'fblc compile'")
    push.add_argument("--serial", "-s", help="adb serial of the device (needed when several are attached)")
    push.add_argument("--runner", metavar="PATH",
                      help="the native runner binary (default: $FBLC_RUNNER, else the README's build folders)")
    push.set_defaults(run=deferred("fblc.cli.train", "cmd_push"))

    verify = commands.add_parser(
        "verify", help="compile MODEL, run one step on the OpenCL device and compare it with onnxruntime",
        description="Compile MODEL's training step, run one step on the local OpenCL device and on onnxruntime with "
                    "the same batch, and compare loss, gradients and updated parameters; exit 1 on a mismatch.")
    add_training_options(verify)
    add_target_options(verify)
    verify.add_argument("--device", default=None, help="OpenCL device (default: local)")
    add_storage_option(verify)
    verify.add_argument("--show", type=int, default=15, help="rows of the error table (default: 15)")
    verify.set_defaults(run=cmd_verify)

    add_check_command(commands)

    devices = commands.add_parser(
        "devices", help="list the OpenCL devices and adb devices fblc can run on",
        description="List the OpenCL devices of this machine (with their image support and whether they build "
                    "fblc's kernels; --device opencl:P:D picks one) and the phones adb sees (--device adb:SERIAL). "
                    "An adb server that the listing had to start is stopped again.")
    devices.set_defaults(run=deferred("fblc.cli.train", "cmd_devices"))
    add_profile_commands(commands)
    add_tune_command(commands)

    for sub in commands.choices.values():
        sub.add_argument("--debug", action="store_true", help="show tracebacks of errors")
        sub.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    return parser


#: commands that build a step and end, run with the cyclic collector off where they are the process's own command
#: line: the compiler pauses it (codegen/collector.py), and the first collection after (a 1B compile's: its
#: millions of objects, all alive, 0.64 CPU s) would find nothing to free before the exit
COLLECTOR_OFF = frozenset({"compile"})


def main(argv: Sequence[str] | None = None) -> int:
    escape_undecodable_names()
    parser = build_parser()
    args = parser.parse_args(argv)  # --help and argument errors exit here
    try:
        check_values(args)
        from fblc.cli.outputs import check_outputs  # imports numpy: after the checks that need none

        check_outputs(args)
        own = argv is None  # the process's own command line: it exits next, and what it holds goes with it
        if own and args.command in COLLECTOR_OFF:
            gc.disable()
        status = int(args.run(args))
        if own:
            gc.freeze()  # the interpreter's last collection skips it (a 1B compile's step graph: 0.7 CPU s)
        return status
    except (FblcError, BundleError) as error:
        if args.debug:
            traceback.print_exc()
        message = error.one_line() if isinstance(error, FblcError) else str(error)
        print(f"fblc: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as interrupt:  # a command may say what it leaves: "after 7 of 50 steps; saved ..."
        print(f"fblc: interrupted {interrupt}".rstrip(), file=sys.stderr)
        return 130
    except Exception as error:  # a bug in fblc or a library: say so in one line unless debugging
        if args.debug:
            raise
        first = str(error).strip().splitlines()[0] if str(error).strip() else ""
        print(f"fblc: internal error: {type(error).__name__}: {first} (rerun with --debug for the traceback "
              "and report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
