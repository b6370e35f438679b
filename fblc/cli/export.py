"""`fblc export BUNDLE --params trained.npz -o model.onnx`: the fine-tuned model back as a standard ONNX file."""

from __future__ import annotations

import argparse
import io
import os
import sys

DESCRIPTION = (
    "Write the model BUNDLE was compiled from with the trained parameters of --params (the file 'fblc run BUNDLE "
    "--save-params' wrote) as a standard ONNX model: same graph, opset and input/output names, adapters merged "
    "into the frozen weights (LoRA: W + A B; MemFLoRA: the conv weight plus U * P, its BatchNorm kept; FuRA-S: "
    "each block's singular values scaled by 1 + delta; a weight other nodes also read, as a tied embedding and "
    "head, gets a merged copy for the adapted layer). The bundle records the model's path and sha256; --model "
    "gives it if it moved. Under --weights int8/int4/fp16 the adapters merge into the model's own fp32 weights. "
    "Weights past 1 GiB go to OUT.data beside it. Nothing is half-written: files are renamed into place once "
    "complete.")


def cmd_export(args: argparse.Namespace) -> int:
    import numpy as np

    from fblc.bundle_format import load_manifest
    from fblc.compiler.model_io import external_data_files, save_model_atomically
    from fblc.errors import FblcError
    from fblc.paths import write_atomically
    from fblc.runtime.specialist import with_fingerprint
    from fblc.tools.export import adapter_tensors, exported_model, load_trained

    trained = load_trained(args.params)
    model, summary = exported_model(args.bundle, trained, args.params, args.model)
    specialist = adapter_tensors(args.bundle, trained) if args.keep_adapters else None
    if os.path.realpath(args.output) == os.path.realpath(summary["source"]):  # the recorded path: not checked up front
        raise FblcError(f"-o '{args.output}' is the model the bundle was compiled from, which the export reads",
                        "choose another -o file (the original stays the base of the bundle)")
    if args.keep_adapters and not specialist:
        raise FblcError(f"--keep-adapters: '{args.bundle}' was compiled without an adapter, so there are no adapter "
                        "tensors to keep", "drop --keep-adapters (the trained model is the whole export)")
    save_model_atomically(model, args.output)
    if specialist is not None:  # with the training bundle's fingerprint: what a served bundle checks it against
        buffer = io.BytesIO()
        np.savez(buffer, **with_fingerprint(specialist, load_manifest(args.bundle).get("fingerprint")))
        write_atomically(args.keep_adapters, lambda handle: handle.write(buffer.getvalue()))
    if not args.quiet:
        changed = (f"{len(summary['merged'])} weight(s) with their adapters merged" if summary["merged"] else
                   f"{len(summary['replaced'])} trained tensor(s) replaced")
        data = external_data_files(args.output)  # OUT.data where the weights pass save_model_atomically's limit
        size = sum(os.path.getsize(path) for path in [args.output, *data])
        print(f"wrote {args.output}{''.join(' and ' + path for path in data)} ({size / 1e6:.2f} MB): "
              f"{summary['source']} with {changed}")
        if summary["copies"]:
            print(f"note: {len(summary['copies'])} adapted weights are also read by other nodes (tied, e.g. an "
                  f"embedding and the head): their adapted layers read merged copies ({summary['copies'][0]}"
                  f"{', ...' if len(summary['copies']) > 1 else ''}), the other readers the weight as it was, as in "
                  "the step", file=sys.stderr)
        if summary["kept"]:
            print(f"note: {len(summary['kept'])} tensors the step updates as state (e.g. '{summary['kept'][0]}': "
                  "--bn-train's running statistics) are not in --params, which holds parameters only: the export keeps "
                  "the model's values of them (an .npz that adds them by name exports them too)", file=sys.stderr)
        if specialist is not None:
            values = sum(int(np.asarray(a).size) for a in specialist.values())
            print(f"wrote {args.keep_adapters} ({os.path.getsize(args.keep_adapters):,} bytes): {len(specialist)} "
                  f"adapter tensors, {values:,} values, unmerged")
    return 0


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    export = commands.add_parser(
        "export", help="write the fine-tuned model (BUNDLE's model with trained parameters) as an ONNX file",
        description=DESCRIPTION)
    export.add_argument("bundle", help="bundle folder from 'fblc compile'")
    export.add_argument("--params", required=True, metavar="FILE.npz",
                        help="the trained parameters ('fblc run BUNDLE --save-params FILE.npz')")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.onnx", help="the ONNX file to write")
    export.add_argument("--model", metavar="PATH",
                        help="the model BUNDLE was compiled from, where it is now (default: the path the bundle "
                             "records; either way its sha256 must match the recorded one)")
    export.add_argument("--keep-adapters", metavar="FILE.npz",
                        help="also write the adapter's trained tensors alone, unmerged, by tensor name (LoRA's A and "
                             "B, MemFLoRA's U, FuRA-S's delta): a specialist file, its bytes printed; it carries the bundle's "
                             "fingerprint (adapter, base model digest, frozen factors, seed), which a served bundle "
                             "compares before loading it")
    export.set_defaults(run=cmd_export)
