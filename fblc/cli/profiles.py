"""Commands about targets: targets (the shipped profiles), profile (measure a device, or show a profile)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from fblc.compiler.errors import FblcError


def cmd_targets(args: argparse.Namespace) -> int:
    from fblc.profiles import load_profile, shipped_targets

    print(f"{'target':<12} {'GPU':<40} {'image max':>13} {'wave':>5} {'block':>6} {'L1 KiB':>7} {'L2 KiB':>7} "
          f"{'GB/s':>6} {'GFLOP/s':>8}  measured figures")
    for name in shipped_targets():
        p = load_profile(name)
        measured = sum(source.startswith("measured") for source in p.sources.values())
        print(f"{p.name:<12} {p.gpu[:40]:<40} {p.image2d_max_width:>6}x{p.image2d_max_height:<6} {p.wave_size:>5} "
              f"{p.tex_block_width:>3}x{p.tex_block_height:<2} {p.l1_bytes // 1024:>7} {p.l2_bytes // 1024:>7} "
              f"{p.bandwidth_gbps:>6.1f} {p.peak_gflops:>8.0f}  {measured}/{len(p.sources)}")
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


def cmd_profile(args: argparse.Namespace) -> int:
    if args.show:
        show_profile(args.show)
        return 0
    if not args.output:
        raise FblcError("fblc profile needs -o FILE.json to write the measured profile (or --show FILE)",
                        "e.g. fblc profile --device local -o mydevice.json")
    if args.device.startswith("adb:"):
        raise FblcError("profiling a phone over adb is not built yet", "run 'fblc profile --device local'")
    from fblc.profiles.profiler import profile_device
    from fblc.runtime.opencl import select_device

    device = select_device(None if args.device == "local" else args.device)
    name = args.name or os.path.splitext(os.path.basename(args.output))[0]
    steps = ["kernels"] + [f"{p} x {t}" for p in ("row-major", "column-major", "block-4", "block-8")
                           for t in (8, 16, 32, 64)] + ["block width and height", "capacity", "bandwidth"]
    if sys.stderr.isatty() and not args.quiet:
        from rich.progress import Progress

        with Progress(transient=True) as progress:
            task = progress.add_task(f"profiling {device.name.strip()}", total=len(steps))
            document = profile_device(device, name, lambda step: progress.update(task, advance=1, description=step))
    else:
        document = profile_device(device, name)
    folder = os.path.dirname(os.path.abspath(args.output))
    handle, temporary = tempfile.mkstemp(prefix=".fblc-", suffix=".json", dir=folder)
    with os.fdopen(handle, "w", encoding="utf-8") as out:
        json.dump(document, out, indent=1)
    os.replace(temporary, args.output)
    if not args.quiet:
        print(f"profiled {device.name.strip()} in {document['measurements']['seconds']:.1f} s; wrote {args.output} "
              f"(compile for it with --target {args.output}; see it with fblc profile --show {args.output})")
    return 0


def add_commands(commands: argparse._SubParsersAction) -> None:
    targets = commands.add_parser("targets", help="list the shipped target profiles and their key figures")
    targets.set_defaults(run=cmd_targets)
    profile = commands.add_parser(
        "profile", help="measure an OpenCL device's texture-cache geometry into a profile (or --show one)",
        description="Run OpenCL microbenchmarks on a device (read patterns x work-group sizes, block and capacity "
                    "probes, bandwidth, FMA peak) and write a profile JSON that --target accepts.")
    profile.add_argument("--device", default="local", help="local or opencl:P:D (default: local)")
    profile.add_argument("-o", "--output", metavar="FILE.json", help="where to write the profile")
    profile.add_argument("--name", help="the profile's name (default: the file name)")
    profile.add_argument("--show", metavar="FILE.json", help="print a profile's figures and patterns, and plot them")
    profile.set_defaults(run=cmd_profile)
