"""Reading ONNX files with clear errors, and writing them atomically."""

from __future__ import annotations

import os
import shutil
import tempfile

import onnx
import onnx_ir as ir
from google.protobuf.message import DecodeError

from fblc.errors import ModelLoadError
from fblc.paths import mode_for, parents_made, write_error

TARGET_OPSET = 18  # the opset of the training graph; older models are converted on load
INLINE_WEIGHTS_LIMIT = 1 << 30  # bytes; larger models keep their weights in a `.data` file beside the model


def _not_a_file(path: str) -> ModelLoadError:
    if not os.path.isdir(path):
        return ModelLoadError(f"cannot read '{path}': no such file", "check the path")
    models = sorted(name for name in os.listdir(path) if name.endswith(".onnx"))
    if len(models) == 1:
        return ModelLoadError(f"'{path}' is a folder, not an ONNX model file",
                              f"give the model in it: {os.path.join(path, models[0])}")
    held = f"it holds {len(models)} .onnx files: {', '.join(models[:3])}{', ...' if len(models) > 3 else ''}" \
        if models else "it holds no .onnx file"
    return ModelLoadError(f"'{path}' is a folder, not an ONNX model file ({held})", "give the model file's path")


def _check(proto: onnx.ModelProto, path: str) -> None:
    """onnx.checker on the file (which also checks where its external data lies), or on the parsed model where
    the file's name is no UTF-8 (bytes a str cannot carry to the checker's C++)."""
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        onnx.checker.check_model(proto)  # external data: checked by _check_external_data
        return
    onnx.checker.check_model(path)


def load_model(path: str) -> ir.Model:
    """Load `path` as an onnx_ir model at opset 18, or raise ModelLoadError saying what is wrong."""
    if not os.path.isfile(path):
        raise _not_a_file(path)
    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError) as error:
        raise ModelLoadError(f"'{path}' is not a readable ONNX model ({type(error).__name__}: "
                             f"{str(error).splitlines()[0] if str(error) else 'protobuf decode failed'})",
                             "the file may be truncated or of another format; export it again") from None
    if not proto.graph.node and not proto.graph.output:
        raise ModelLoadError(f"'{path}' holds no ONNX graph", "the file may be truncated or of another format")
    try:
        _check(proto, path)
    except onnx.checker.ValidationError as error:
        if not _tolerated(str(error)):
            raise ModelLoadError(f"'{path}' is not a valid ONNX model: {str(error).strip().splitlines()[0]}",
                                 "export it again, or fix the named node") from None
    except UnicodeDecodeError as error:  # a name or string attribute that is no UTF-8: damaged bytes
        raise ModelLoadError(f"'{path}' is not a valid ONNX model: a name or string holds bytes that are not "
                             f"UTF-8 ({error.reason} at byte {error.start})",
                             "the file is damaged; export it again") from None
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), TARGET_OPSET)
    if opset < TARGET_OPSET:
        try:
            proto = onnx.version_converter.convert_version(proto, TARGET_OPSET)
        except Exception as error:  # the converter raises bare RuntimeErrors with C++ messages
            raise ModelLoadError(f"cannot convert '{path}' from opset {opset} to {TARGET_OPSET}: "
                                 f"{str(error).splitlines()[0]}", "export the model at opset 18") from None
    try:
        model = ir.serde.deserialize_model(proto)
    except ir.serde.SerdeError as error:  # a field the checker let through that onnx_ir cannot read
        cause = error.__cause__ or error
        raise ModelLoadError(f"'{path}' is not a readable ONNX model: {type(cause).__name__}: "
                             f"{str(cause).splitlines()[0] if str(cause) else 'cannot deserialize'}",
                             "the file is damaged; export it again") from None
    _check_names(model, path)
    ir.external_data.set_base_dir(model.graph, os.path.dirname(os.path.abspath(path)))
    _check_external_data(model, path)
    return model


def _external_tensors(model: ir.Model) -> list[ir.ExternalTensor]:
    return [v.const_value for graph in model.graphs() for v in graph.initializers.values()
            if isinstance(v.const_value, ir.ExternalTensor)]


def _check_external_data(model: ir.Model, path: str) -> None:
    """Raise ModelLoadError for an external data file that is missing or too short for a tensor it holds:
    found here, by its size, rather than as a failed read in the middle of a pass."""
    sizes: dict[str, int] = {}
    for tensor in _external_tensors(model):
        data = tensor.path
        if data not in sizes:
            try:
                sizes[data] = os.path.getsize(data)
            except OSError:
                raise ModelLoadError(f"'{path}': the external data file '{tensor.location}' of tensor "
                                     f"'{tensor.name}' is not there ({data})", "put it beside the model, or export "
                                     "the model again") from None
        offset = tensor.offset or 0
        found = max(0, sizes[data] - offset)
        if found < tensor.nbytes:
            raise ModelLoadError(f"'{path}': tensor '{tensor.name}' needs {tensor.nbytes} bytes at offset {offset} of "
                                 f"its external data file '{data}', which holds {found} bytes from there "
                                 f"({sizes[data]} in all)", "the file is truncated or from another export: copy it "
                                 "again whole, or export the model again")


def external_data_files(path: str) -> list[str]:
    """The external data files the initializers of the model `path` name, beside it, without reading any
    weights; [] for a file that is no readable model (load_model says why)."""
    return sorted(external_data_offsets(path))


def external_data_offsets(path: str) -> dict[str, list[int]]:
    """Each external data file the initializers of the model `path` name (beside it) -> the offsets at which
    its tensors start, sorted; read without any weights; {} for a file that is no readable model."""
    try:
        proto = onnx.load(path, load_external_data=False)
    except (DecodeError, RuntimeError, ValueError, OSError):  # load_model reports it with its own message
        return {}
    folder = os.path.dirname(os.path.abspath(path))
    offsets: dict[str, set[int]] = {}
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            entries = {entry.key: entry.value for entry in tensor.external_data}
            if "location" in entries:
                starts = offsets.setdefault(os.path.join(folder, entries["location"]), set())
                offset = entries.get("offset", "0")
                starts.add(int(offset) if offset.isdigit() else 0)  # a malformed one: load_model names it
    return {file: sorted(starts) for file, starts in offsets.items()}


def _check_names(model: ir.Model, path: str) -> None:
    """Raise ModelLoadError for a node or tensor name that is not text.

    protobuf hands a name with non-UTF-8 bytes over as `bytes`; nothing downstream could write it back.
    """
    for node in ir.traversal.RecursiveGraphIterator(model.graph):
        for name, what in [(node.name, "node")] + [(value.name, "tensor") for value in node.outputs if value]:
            if name is not None and not isinstance(name, str):
                raise ModelLoadError(f"'{path}' is not a valid ONNX model: the {what} name {name!r} of a "
                                     f"{node.op_type} node is not UTF-8 text", "the file is damaged; export it again")


#: ops the checker calls deprecated at the model's opset that onnxruntime still runs and fblc reads
TOLERATED_DEPRECATIONS = {
    "GroupNormalization": "opset 18-20's per-group scale and bias, lowered at import (passes/lower_composites.py)",
}


def _tolerated(message: str) -> bool:
    """Whether the checker's only complaint is a deprecated op of TOLERATED_DEPRECATIONS."""
    return "is deprecated in domain_version" in message and any(
        f"Op registered for {op} is deprecated" in message for op in TOLERATED_DEPRECATIONS)


def _weight_bytes(model: ir.Model) -> int:
    return sum(v.const_value.nbytes for v in model.graph.initializers.values() if v.const_value is not None)


def save_model_atomically(model: ir.Model, path: str) -> None:
    """Write a self-contained `path` (weights inline, or in `path.data` past 1 GiB) only once complete.

    Files are written into a temporary folder beside `path`, then renamed into place, so a
    failure (a full disk) leaves nothing behind, the parent folders made for it included, and
    raises an FblcError naming the file.
    """
    folder = os.path.dirname(os.path.abspath(path))
    try:
        with parents_made(folder):
            staging = tempfile.mkdtemp(prefix=".fblc-", dir=folder)
            try:
                _write_and_place(model, staging, path)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    except OSError as error:
        raise write_error("the ONNX model", path, error) from None


def _write_and_place(model: ir.Model, staging: str, path: str) -> None:
    """Write `path`'s files into `staging`, then rename them into place: the weights' .data first (past the
    limit), removed again if the model's rename fails."""
    name = os.path.basename(path)
    if _weight_bytes(model) <= INLINE_WEIGHTS_LIMIT:
        if _has_external(model):
            ir.external_data.load_to_model(model)
        ir.save(model, os.path.join(staging, name))
        _place(os.path.join(staging, name), path)
        return
    ir.save(model, os.path.join(staging, name), external_data=name + ".data")
    _place(os.path.join(staging, name + ".data"), path + ".data")
    try:
        _place(os.path.join(staging, name), path)
    except BaseException:
        os.unlink(path + ".data")
        raise


def _place(written: str, path: str) -> None:
    """Rename `written` to `path` with the mode of the file it replaces, else the umask's (not mkdtemp's)."""
    os.chmod(written, mode_for(path))
    os.replace(written, path)


def _has_external(model: ir.Model) -> bool:
    return any(isinstance(v.const_value, ir.ExternalTensor) for v in model.graph.initializers.values())
