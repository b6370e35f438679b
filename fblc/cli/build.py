"""Commands that build: train-graph (the step as ONNX), compile (the bundle), verify (bundle vs onnxruntime)."""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

from fblc.choices import FORWARD
from fblc.cli.options import pass_progress, training_options


def cmd_train_graph(args: argparse.Namespace) -> int:
    from fblc.compiler.model_io import load_model, save_model_atomically
    from fblc.compiler.optional_state import with_optional_state
    from fblc.compiler.summary import summarize_step
    from fblc.passes.pipeline import build_training_graph, training_pipeline

    options = training_options(args)
    started = time.perf_counter()
    model = load_model(args.model)
    with pass_progress(len(training_pipeline(options)), enabled=not args.quiet) as on_pass:
        step = build_training_graph(model, options, dump_dir=args.dump_dir, on_pass=on_pass)
    built = time.perf_counter() - started
    summary = summarize_step(step)
    # by default the state inputs as optional tensors with their current values as defaults: onnxruntime
    # loads the file without a warning per parameter (fblc.compiler.optional_state)
    save_model_atomically(step if args.plain_state_inputs else with_optional_state(step), args.output)
    if not args.quiet:
        print(summary)
        print(f"wrote {args.output} ({os.path.getsize(args.output) / 1e6:.1f} MB) in {built:.2f} s"
              + (f"; pass dumps in {args.dump_dir}/" if args.dump_dir else ""))
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    from fblc.codegen.compile import compile_model
    from fblc.passes.pipeline import compile_pipeline
    from fblc.profiles import load_profile
    from fblc.tools.cache_report import cache_annex
    from fblc.tools.traced_layouts import with_traced_reads

    options = training_options(args)
    profile = load_profile(args.target)
    annexes = {"cache": cache_annex(profile)} if args.cache_report else None
    if options.layout_search == "traced" and options.layout == "rtile" and not args.quiet:
        print(f"tracing the reads of the step's kernels on the local OpenCL device ({args.target}'s cache model "
              "scores them)", file=sys.stderr)
    options = with_traced_reads(args.model, args.target, args.dtype, options)
    with pass_progress(len(compile_pipeline(options, profile)), enabled=not args.quiet) as on_pass:
        step, report = compile_model(args.model, args.output, args.target, args.dtype, options,
                                  dump_dir=args.dump_dir, on_pass=on_pass, annexes=annexes,
                                  schedules=args.schedules)
    if options.weights.weights != "fp32" and not report["weights"]["quantized"]:  # else only report.json shows it
        print(f"fblc: --weights {options.weights.weights} changed nothing: it stores frozen MatMul/Gemm, Conv and "
              "embedding weights, and this step has none (every weight trains; --adapter or --freeze REGEX freezes "
              "them)", file=sys.stderr)
    if not args.quiet:
        families = ", ".join(f"{count} {family}" for family, count in sorted(report["kernels_per_family"].items()))
        print(f"compiled {args.model} for {args.target} ({args.dtype}) in {report['compile_seconds']:.2f} s: "
              f"{report['distinct_kernels']} distinct kernels ({report['kernels']} launches: {families}), "
              f"{report['textures']} textures, "
              f"{report['texture_bytes'] / 1e6:.1f} MB of textures")
        print(f"wrote bundle {args.output.rstrip('/') or '/'}/ (manifest.json, plan.json, kernels.cl, "
              f"kernels.buffer.cl, params.bin, report.json)")
        from fblc.compiler.summary import adapter_lines

        trained = report["trained"]["tensors"]
        outputs = ", ".join(f"'{v.name}'" for v in step.graph.outputs) if options.trainer == FORWARD else ""
        if outputs and "specialist" in report["weights"]["bytes"]:
            print(specialist_summary(report))
        print(f"a forward bundle (no loss, backward or optimizer): its step reads the model's inputs and writes "
              f"{outputs}; run it with fblc run BUNDLE --infer --data INPUTS.npz" if outputs else
              "\n".join(adapter_lines(report.get("adapter")) + [
            f"trains {len(trained)} tensor{'s' if len(trained) != 1 else ''} "
            f"({sum(math.prod(t['shape']) for t in trained):,} values), chosen by {report['trained']['chosen_by']}; "
            "report.json 'trained' and `fblc check` list them, --freeze REGEX excludes some"]))
        beyond = report["beyond_portable_edge"]
        if beyond:
            largest = max(beyond, key=lambda t: t["width"] * t["height"])
            print(f"note: {len(beyond)} textures do not fit {report['portable_image_edge']} x "
                  f"{report['portable_image_edge']} and use {args.target}'s own image limit (largest: "
                  f"'{largest['name']}', {largest['width']} x {largest['height']}); the bundle runs only on devices "
                  f"with images that large (report.json beyond_portable_edge lists them)")
        if args.report:
            from fblc.codegen.reports import estimate_summary, layout_summary

            print(layout_summary(report["layout"]))
            print(estimate_summary(report["estimate"]))
        if "cache" in report:
            from fblc.tools.cache_report import cache_summary

            print(cache_summary(report["cache"]))
    return 0


def specialist_summary(report: dict) -> str:
    """The compile summary's line on a forward bundle's adapter sites: what a specialist replaces, what stays shared."""
    weights = report["weights"]
    adapter = report["adapter"]
    count = len(adapter["adapted"])
    return (f"adapter sites ({adapter['adapter']}, {count} {adapter['unit']}{'s' if count != 1 else ''}): "
            f"{weights['bytes']['specialist']:,} bytes "
            f"of adapter tensors that a specialist replaces at run time (fblc run BUNDLE --infer --specialist S.npz); "
            f"{weights['shared']:,} bytes of weights shared by every specialist (report.json 'weights')")


def cmd_verify(args: argparse.Namespace) -> int:
    from fblc.tools.verify import TOLERANCES, verify_model

    options = training_options(args)
    rows = verify_model(args.model, options, target=args.target, dtype=args.dtype, device=args.device,
                        storage=args.storage)
    failed = [r for r in rows if not r.ok]
    rtol, atol = TOLERANCES[args.dtype]
    if not args.quiet:
        worst = sorted(rows, key=lambda r: (r.ok, -r.max_rel))[: args.show]
        print(f"{'tensor':<56} {'max abs err':>12} {'max rel err':>12}  ok")
        for row in worst:
            print(f"{row.name[:56]:<56} {row.max_abs:12.3e} {row.max_rel:12.3e}  {'yes' if row.ok else 'NO'}")
        print(f"{len(rows) - len(failed)}/{len(rows)} tensors match onnxruntime within rtol {rtol:g}, atol {atol:g} "
              f"({args.dtype})")
    return 1 if failed else 0


def add_target_options(parser: argparse.ArgumentParser) -> None:
    from fblc.profiles import shipped_targets

    parser.add_argument("--target", default="local",
                        help=f"target GPU: {', '.join(shipped_targets())}, or a profile .json (default: local)")
    parser.add_argument("--dtype", choices=["fp32", "fp16"], default="fp32",
                        help="texture storage. fp16 is mixed precision: activations and their gradients in half "
                             "textures; parameters, the gradients the optimizer reads and its state in fp32 (master "
                             "weights); fp32 accumulation in every kernel; dynamic loss scaling (--loss-scale) "
                             "(default: fp32)")
    parser.add_argument("--layout", choices=["rtile", "naive"], default="rtile",
                        help="rtile: R-Tile texture layouts, transposes and reshapes as index maps; naive: flat "
                             "row-major textures with explicit copy kernels, the conventional baseline (default: rtile)")
    from fblc.choices import LAYOUT_SEARCHES

    parser.add_argument("--layout-search", choices=LAYOUT_SEARCHES, default=LAYOUT_SEARCHES[0],
                        help="under rtile, how each tensor's layout is chosen: blocks (the cache blocks that "
                             "synthetic walks of its readers touch), traced (the step's kernels first run once on "
                             "the local OpenCL device recording what they read; those reads through the target's "
                             "cache model decide: a longer compile, fewer misses), flat (no tiles, kernels as under "
                             "rtile: an ablation) (default: blocks)")
    parser.add_argument("--weights", choices=["fp32", "fp16", "int8", "int4"], default="fp32",
                        help="storage of the frozen MatMul/Gemm weights (never trainable ones or adapter factors): "
                             "int8/int4 signed integers in groups of --weight-group along the reduction axis, one "
                             "fp16 scale a group, packed 4 or 8 a 32-bit word and dequantized on the device "
                             "(ONNX DequantizeLinear, opset 21); fp16 half weights cast to float (default: fp32, "
                             "as the model stores them)")
    parser.add_argument("--weight-group", type=int, default=32, metavar="N",
                        help="--weights int8/int4: elements per scale along the reduction axis (default: 32)")
