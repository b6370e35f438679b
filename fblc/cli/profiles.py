"""Commands about targets: targets (the shipped profiles), profile (measure a device, or show a profile)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Callable

from fblc.paths import write_atomically
from fblc.errors import FblcError


def cmd_targets(args: argparse.Namespace) -> int:
    from fblc.profiles import load_profile, shipped_targets

    print(f"{'target':<12} {'GPU':<40} {'image max':>13} {'wave':>5} {'units':>5} {'holds':>6} {'block':>6} "
          f"{'L1 KiB':>7} {'L2 KiB':>7} {'GB/s':>6} {'GFLOP/s':>8}  {'half':<4} {'subgr':<5} measured figures")
    yes_no = {True: "yes", False: "no"}
    for name in shipped_targets():
        p = load_profile(name)
        measured = sum(source.startswith("measured") for source in p.sources.values())
        print(f"{p.name:<12} {p.gpu[:40]:<40} {p.image2d_max_width:>6}x{p.image2d_max_height:<6} {p.wave_size:>5} "
              f"{p.compute_units:>5} {p.device_items:>6} {p.tex_block_width:>3}x{p.tex_block_height:<2} "
              f"{p.l1_bytes // 1024:>7} {p.l2_bytes // 1024:>7} {p.bandwidth_gbps:>6.1f} {p.peak_gflops:>8.0f}  "
              f"{yes_no[p.fp16]:<4} {yes_no[p.subgroups]:<5} {measured}/{len(p.sources)}")
    print("units: compute units; holds: work-items the device runs at once (units x waves per unit x wave); "
          "half: cl_khr_fp16 arithmetic; subgr: cl_khr_subgroups")
    print("every figure's source: fblc/profiles/targets/<target>.json; 'fblc profile' measures a device")
    return 0


def show_profile(path: str) -> str:
    """Print the figures and the pattern table of a profile; write its throughput plot; returns the plot's path."""
    from fblc.profiles import load_profile

    profile = load_profile(path)
    print(f"{profile.name}: {profile.gpu} ({profile.vendor}, OpenCL {profile.opencl_version})")
    for name, source in profile.sources.items():
        print(f"  {name:<20} {getattr(profile, name)!s:>12}   {source}")
    measurements = profile.raw.get("measurements", {}).get("relative_to_column_major")
    if not measurements:
        print("(no pattern measurements: this profile was not written by 'fblc profile')")
        return ""
    threads = sorted({int(t) for row in measurements.values() for t in row})
    print("\nread throughput relative to column-major, by work-group size:")
    print(f"  {'pattern':<14}" + "".join(f"{t:>8}" for t in threads))
    for pattern, row in measurements.items():
        print(f"  {pattern:<14}" + "".join(f"{row.get(str(t), float('nan')):>8.2f}" for t in threads))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 4))
    for pattern, row in profile.raw["measurements"]["pattern_reads_per_second"].items():
        points = sorted((int(t), v / 1e6) for t, v in row.items())
        axes.plot([t for t, _ in points], [v for _, v in points], marker="o", label=pattern)
    axes.set_xscale("log", base=2)
    axes.set_xlabel("work-items per work-group")
    axes.set_ylabel("texel reads / s (millions)")
    axes.set_title(f"{profile.name}: image read patterns")
    axes.legend()
    plot = os.path.splitext(path)[0] + ".png"
    figure.tight_layout()
    figure.savefig(plot, dpi=120)
    plt.close(figure)
    print(f"\nplot: {plot}")
    return plot


def _runner_progress(where: str, quiet: bool) -> Callable[[dict[str, Any]], None]:
    """Print the runner's progress lines as they come (a phone takes a while; silence would look like a hang)."""
    def on_line(line: dict[str, Any]) -> None:
        if quiet:
            return
        if "device" in line:
            print(f"profiling {line['device']} {where} (benchmarks built in {line['build_ms'] / 1e3:.1f} s; "
                  f"{line['launches']} launches)", flush=True)
        elif "done" in line:
            print(f"  {line['done']:<24} {line['launches']:>4}/{line['of']} launches {line['seconds']:7.1f} s",
                  flush=True)
    return on_line


def _runner_failed(message: str) -> FblcError:
    """The runner's error as an fblc error: its first line, what to do, then any compiler log below."""
    from fblc.profiles.profiler import REMEDY, with_log

    head, _, log = message.partition("\n")
    return FblcError(head.rstrip(": "), with_log(REMEDY, log))


def _host_runner(explicit: str | None) -> str:
    """A runner binary that runs on this machine: --runner, $FBLC_RUNNER, else the README's host build."""
    import platform

    from fblc.runtime.native import UNAME_MACHINES, RunnerError, binary_kind, build_command, runner_candidates

    machine = UNAME_MACHINES.get(platform.machine(), platform.machine())
    candidates = [p for p in runner_candidates(explicit) if os.path.isfile(p)]
    for path in candidates:
        kind = binary_kind(path)
        if kind.machine == machine and kind.system in ("linux", "static"):
            return path
    found = "; ".join(f"{p} is {binary_kind(p)}" for p in candidates) or "none built"
    raise RunnerError(f"no native runner for this {machine} machine ({found}); pass --runner PATH, or build one "
                      f"(README: 'Phones') with: {build_command()}")


def _measure(args: argparse.Namespace, plan: dict[str, Any]) -> dict[str, Any]:
    """The plan's raw results from the backend --device names: pyopencl here, the native runner here, or a phone."""
    from fblc.profiles.profiler import plan_steps
    from fblc.profiles.pyopencl_timing import measure_with_pyopencl

    if args.device.startswith("adb:"):
        from fblc.runtime.adb import Adb, RunnerFailed
        from fblc.runtime.adb_profile import profile_on_device

        adb = Adb()
        serial = adb.choose(args.device[len("adb:"):] or None)
        say = (lambda text: None) if args.quiet else (lambda text: print(text, flush=True))
        try:
            return profile_on_device(adb, serial, plan, runner=args.runner,
                                     on_line=_runner_progress(f"on {serial}", args.quiet), say=say)
        except RunnerFailed as error:
            raise _runner_failed(str(error)) from None
    if args.device == "native" or args.device.startswith("native:"):
        from fblc.runtime.native import RunnerError, pocl_wheel_environment, profile_with_runner

        runner = _host_runner(args.runner)
        try:
            return profile_with_runner(runner, plan, device=args.device[len("native:"):] or None,
                                       env=pocl_wheel_environment(),
                                       on_line=_runner_progress(f"with {runner}", args.quiet))
        except RunnerError as error:
            raise _runner_failed(f"the runner failed: {error}") from None
    from fblc.runtime.opencl import select_device

    device = select_device(None if args.device == "local" else args.device)
    if sys.stderr.isatty() and not args.quiet:
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task(f"profiling {device.name.strip()}", total=1 + len(plan_steps(plan)))
            return measure_with_pyopencl(device, plan, lambda step: progress.update(task, advance=1, description=step))
    return measure_with_pyopencl(device, plan)


def cmd_profile(args: argparse.Namespace) -> int:
    if args.show:
        show_profile(args.show)
        return 0
    if not args.output:
        raise FblcError("fblc profile needs -o FILE.json to write the measured profile (or --show FILE)",
                        "e.g. fblc profile --device local -o mydevice.json")
    from fblc.profiles.profiler import interpret, measurement_plan

    plan = measurement_plan()
    name = args.name or os.path.splitext(os.path.basename(args.output))[0]
    document = interpret(plan, _measure(args, plan), name)
    write_atomically(args.output, lambda out: out.write(json.dumps(document, indent=1).encode()))
    if not args.quiet:
        print(f"profiled {document['gpu']} in {document['measurements']['seconds']:.1f} s; wrote {args.output} "
              f"(compile for it with --target {args.output}; see it with fblc profile --show {args.output})")
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    targets = commands.add_parser(
        "targets", help="list the shipped target profiles and their key figures",
        description="List the target profiles fblc ships (--target NAME): each one's GPU, image limit, wave size, "
                    "texture-cache block and L1/L2 sizes, bandwidth, peak, and how many of its figures were "
                    "measured on the device. A profile of your own: fblc profile.")
    targets.set_defaults(run=cmd_targets)
    profile = commands.add_parser(
        "profile", help="measure an OpenCL device's texture-cache geometry into a profile (or --show one)",
        description="Run OpenCL microbenchmarks on a device (read patterns x work-group sizes, block and capacity "
                    "probes, bandwidth, FMA peak) and write a profile JSON that --target accepts. On a phone "
                    "(--device adb:SERIAL) the native runner times them and fblc reads its timings as a local run's.")
    profile.add_argument("--device", default="local",
                         help="local or opencl:P:D (pyopencl here), native[:P:D] (the native runner here, on the "
                              "pyopencl wheel's PoCL unless OCL_ICD_VENDORS says otherwise), or adb:SERIAL (a phone: "
                              "pushes the native runner, runs the benchmarks in adb shell) (default: local)")
    profile.add_argument("--runner", metavar="PATH",
                         help="with native or adb: the runner binary (default: $FBLC_RUNNER, else the README's build "
                              "folders)")
    profile.add_argument("-o", "--output", metavar="FILE.json", help="where to write the profile")
    profile.add_argument("--name", help="the profile's name (default: the file name)")
    profile.add_argument("--show", metavar="FILE.json", help="print a profile's figures and patterns, and plot them")
    profile.set_defaults(run=cmd_profile)
