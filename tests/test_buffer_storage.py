"""LocalRunner's storage "buffer": the bundle's kernels.buffer.cl, the kernels of kernels.cl rendered with
every texture's texels held in index order in a __global buffer (a texel's address is its index, not its
layout's coordinate), for a CPU's OpenCL whose images are software.

Golden: each kernel argument of kernels.buffer.cl is a buffer of the C type of its texture's format,
each of kernels.cl an image2d_t; plan.json's `lines` and `buffer_lines` are each kernel's lines in the
two files; an R-Tile parameter's buffer holds its texels in index order. Numeric: one step in buffer storage equals
onnxruntime's (fp32 and fp16 textures, saved masks, integer ids, shared register tiles, images
shared by textures of disjoint lifetimes), and three steps (the P / P.new swap) equal the image
storage's losses. Negative: an unknown storage, a bundle without kernels.buffer.cl (an earlier fblc's),
and buffers asked of a phone's native runner.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from collections import Counter
from typing import Any

import numpy as np
import pytest

from fblc.bundle_format import BUFFER_C_TYPES, BundleError
from fblc.cli import main
from fblc.codegen import ir as kir
from fblc.codegen.compile import compile_model
from fblc.compiler.gradients import segment_sum
from fblc.compiler.optimizers import OptimizerConfig
from fblc.passes.pipeline import TrainingOptions
from fblc.runtime.device_memory import overlapping
from fblc.runtime.local import LocalRunner
from fblc.texel_layout import flat_layout
from fblc.tools.verify import verify_model
from support import models
from tests.support.kernel_ir import lowered_kernels, of_type, profile_with, statements
from tests.support.oclgrind_steps import CASES

# the MLP, a conv net with BatchNorm, pools and saved masks, shared register tiles; fp16 on the MLP
STEPS = [("mlp", "fp32"), ("mlp", "fp16"), ("convnet", "fp32"), ("shared tiles", "fp32")]


@pytest.mark.parametrize("name, dtype", STEPS)
def test_a_step_in_buffers_equals_onnxruntime(name: str, dtype: str, tmp_path) -> None:
    path, feeds, options = CASES[name](str(tmp_path))
    if dtype == "fp16":  # SGD: Adam's first step magnifies fp16's last bits past the tolerance (test_device_models)
        options = dataclasses.replace(options, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    rows = verify_model(path, options, target="adreno830", dtype=dtype, feeds=feeds or None, storage="buffer")
    assert rows and not [r.name for r in rows if not r.ok], [r for r in rows if not r.ok]


def test_integer_ids_and_their_sorted_scatter_in_buffers(monkeypatch, tmp_path) -> None:
    """Repeated and negative token ids (rgba_i32 textures read with RDI) through the sorted row scatter."""
    from tests.test_sort_scatter_rows import OPTIONS, embedding

    monkeypatch.setattr(segment_sum, "ONE_HOT_ELEMENTS", 0)
    path = str(tmp_path / "embedding.onnx")
    embedding(path, 37, 8, (2, 70))
    feeds = {"ids": np.random.default_rng(3).integers(-37, 37, (2, 70)).astype(np.int64)}
    rows = verify_model(path, OPTIONS, target="adreno830", feeds=feeds, storage="buffer")
    assert rows and not [r.name for r in rows if not r.ok]


def test_kernel_arguments_carry_their_format_and_three_steps_equal_the_images(tmp_path) -> None:
    exported = models.mlp(str(tmp_path))
    bundle = str(tmp_path / "bundle")
    _, report = compile_model(exported.path, bundle, "adreno830", "fp16", TrainingOptions(input_shapes=exported.input_shapes))
    images, buffers = (open(f"{bundle}/{name}").read() for name in ("kernels.cl", "kernels.buffer.cl"))
    plan = json.load(open(f"{bundle}/plan.json"))
    formats = [t["format"] for t in plan["textures"]]
    # every kind of texel by its C type: float, half, int and a mask's bytes (the ReLU masks' r_mask4 here; the
    # r_mask8 this test once had was the non-finite flag the optimizer's gates read, gone with commit_if_finite)
    assert {"rgba_f32", "rgba_f16", "rgba_i32"} <= set(formats) and set(formats) & {"r_mask4", "r_mask8"}, \
        "the test model should have every kind of texture"
    for launch in plan["kernels"]:
        for source, key, access in ((images, "lines", r"(read|write)_only image2d_t"),
                                    (buffers, "buffer_lines", r"__global (const )?(\w+)\* restrict")):
            first, last = launch[key]
            function = source.splitlines()[first:last]  # after the comment line: the __kernel .. its closing }, after
            # the functions of co-launched parts that it is the first to call (codegen/co_launch.py)
            function = function[next(k for k, line in enumerate(function) if "__kernel void" in line):]
            # a group kernel states its work-group size first (reqd_work_group_size: plan.json's local_size)
            group = rf"__attribute__\(\(reqd_work_group_size\({launch['local_size'][0]}, 1, 1\)\)\) "
            assert re.match(rf"({group})?__kernel void {launch['function']}\(", function[0]) and function[-1] == "}", key
            declared = re.findall(rf"{access} (\w+)", function[0])
            assert [d[-1] for d in declared] == [f"out{k}" for k in range(len(launch["outputs"]))] + \
                [f"in{k}" for k in range(len(launch["inputs"]))], launch["name"]
            if key == "buffer_lines":  # outputs writable, inputs const, each of its format's C type
                assert [d[:2] for d in declared] == [("", BUFFER_C_TYPES[formats[t]]) for t in launch["outputs"]] + \
                    [("const ", BUFFER_C_TYPES[formats[t]]) for t in launch["inputs"]], launch["name"]
    # buffers address a texel by its index: no image call, sampler or layout coordinate is left
    assert not re.search(r"image2d_t|read_image|write_image|SMP|TEXEL_P2|RTILE_|NOTE\(", buffers)
    batch = {**exported.inputs, "labels": exported.labels}
    runners = {storage: LocalRunner(bundle, storage=storage, progress=False) for storage in ("image", "buffer")}
    losses = {storage: _three_steps(runner, batch) for storage, runner in runners.items()}
    assert np.allclose(losses["buffer"], losses["image"], rtol=1e-6, atol=0), losses
    # buffers: one arena, each texture a sub-buffer of its slot, textures of disjoint lifetimes sharing bytes;
    # images here (no cl_khr_image2d_from_buffer on PoCL or oclgrind): the images shared by format and width
    memory = report["memory"]
    assert runners["buffer"].allocated_bytes == memory["arena_bytes"] == plan["arena"]["bytes"]
    assert runners["buffer"].allocated_images == 1 and overlapping(plan["textures"])
    if "cl_khr_image2d_from_buffer" not in runners["image"].device.extensions:
        assert "cl_khr_image2d_from_buffer" in runners["image"].arena_reason
        assert runners["image"].allocated_images == len(plan["images"])
        if "portable" in runners["image"].device.platform.name.lower():  # PoCL: an image takes exactly its texels
            assert runners["image"].allocated_bytes == memory["shared_image_bytes"]
    # an R-Tile texture with an image of its own, read right after its last use (the arena may give its slot to
    # a later texture): the image holds it tiled, the buffer in index order
    name, texture = next((name, plan["textures"][t]) for name, t in plan["values"].items()
                         if plan["textures"][t].get("layout", {}).get("kind") == "rtile"
                         and len(plan["images"][plan["textures"][t]["image"]]["textures"]) == 1
                         and name not in plan["value_maps"]
                         and plan["value_shapes"].get(name, plan["textures"][t]["shape"]) == plan["textures"][t]["shape"])
    for runner in runners.values():  # a fourth step up to the texture's last use
        for entry in runner.manifest["inputs"]:
            runner.upload(entry["texture"], np.asarray(batch[entry["name"]]))
        for index in runner.launch_sequence(0, texture["lifetime"][1] + 1):
            runner.launch(index)
        runner.queue.finish()
    buffer = runners["buffer"]
    held = np.empty(int(np.prod(texture["shape"])), dtype=np.float16)
    buffer.cl.enqueue_copy(buffer.queue, held, buffer.images[buffer.binding[texture["id"]]])
    assert np.allclose(held.reshape(texture["shape"]), runners["image"].read(name), rtol=1e-3, atol=1e-4), name


def _three_steps(runner: LocalRunner, batch: dict[str, np.ndarray]) -> list[float]:
    return [runner.step(batch) for _ in range(3)]


@pytest.fixture(scope="module")
def mlp_bundle(tmp_path_factory) -> tuple[models.ExportedModel, str]:
    """The MLP compiled for the local device, fp32: (its export, the bundle folder)."""
    directory = tmp_path_factory.mktemp("buffer_storage_mlp")
    exported = models.mlp(str(directory))
    bundle = str(directory / "bundle")
    compile_model(exported.path, bundle, "local", "fp32", TrainingOptions(input_shapes=exported.input_shapes))
    return exported, bundle


def test_an_unknown_storage_buffers_on_a_phone_or_an_old_bundle_are_refused(mlp_bundle, tmp_path, capsys) -> None:
    with pytest.raises(ValueError, match="storage 'texture': choose one of auto, image, buffer"):
        LocalRunner(str(tmp_path), storage="texture")
    _, compiled = mlp_bundle
    bundle = tmp_path / "bundle"
    shutil.copytree(compiled, bundle)
    (bundle / "kernels.buffer.cl").unlink()  # as a bundle of an earlier fblc, which built kernels.cl for buffers
    with pytest.raises(BundleError, match="kernels.buffer.cl is missing; compile the bundle again"):
        LocalRunner(str(bundle), storage="buffer", progress=False)
    data = tmp_path / "data.npz"
    np.savez(data, x=np.zeros((1, 1), np.float32))
    assert main(["run", str(tmp_path), "--device", "adb:emulator-5554", "--storage", "buffer",
                 "--data", str(data)]) != 0
    assert "--storage buffer is for a local OpenCL device" in capsys.readouterr().err


def test_fblc_run_trains_in_buffers_as_in_images(mlp_bundle, tmp_path, capsys) -> None:
    """`fblc run --storage buffer` prints the same losses as --storage image; a storage given is used
    without a note (the default, auto, says what it chose: tests/test_bad_runs.py)."""
    exported, bundle = mlp_bundle
    data = str(tmp_path / "data.npz")
    np.savez(data, **exported.inputs, labels=exported.labels)
    losses = {}
    for storage in ("image", "buffer"):
        assert main(["run", bundle, "--data", data, "--steps", "2", "--json", "--storage", storage]) == 0
        out, err = capsys.readouterr()
        losses[storage] = [json.loads(line)["loss"] for line in out.splitlines()]
        assert "note: --storage auto" not in err
    assert len(losses["image"]) == 2 and np.allclose(losses["buffer"], losses["image"], rtol=1e-6, atol=0), losses


def _offset(texel: kir.Expr) -> tuple[kir.Expr, int]:
    """(base, literal offset) of a texel index as fetch builds it: a variable plus or minus a literal."""
    if isinstance(texel, kir.Binary) and texel.op in "+-" and isinstance(texel.b, kir.Const):
        return texel.a, int(texel.b.value) * (1 if texel.op == "+" else -1)
    return texel, 0


def _form(texel: kir.Expr) -> str:
    """The function a texel index is clamped with (clamp, min, ...), or "plain"."""
    return texel.function if isinstance(texel, kir.Call) else "plain"


def window_misreads(kernels: list[Any], texels: dict[int, int]) -> tuple[list[str], Counter[str], Counter[str]]:
    """WINDOW(img, a, b, q, x, s) is one unaligned load of texels q and q + 1 in buffers (BufferStorage, at element
    x = q * 4 + s), the shuffle of a and b in images: the two agree only where a is texel q as read, and b texel q + 1 or, where that
    passes the tensor's last texel, the last (`min(q + 1, last)`: the buffer's load reads LocalRunner's
    texel of slack there, lanes the kernel leaves unused). Any other form of a read that feeds WINDOW
    (a clamp to the tensor, a min elsewhere) is a misread. (misreads, texel reads by the form of their
    index, those that feed a WINDOW likewise.) `texels`: each texture's texels, by id."""
    misreads: list[str] = []
    forms: Counter[str] = Counter()
    windowed: Counter[str] = Counter()
    for kernel in kernels:
        reads = {s.var: s.init for s in statements(kernel)
                 if isinstance(s, kir.Declare) and s.var.kind == "T" and isinstance(s.init, kir.Load)}
        forms.update(_form(read.texel) for read in reads.values())
        for window in of_type(kernel, kir.Call):
            if window.function != "WINDOW":
                continue
            image, a, b, q, _, _ = window.args  # the fifth: the element q * 4 + s (the buffer load's)
            last = texels[kernel.inputs[image.argument.index]] - 1
            read_a, read_b = reads.get(a), reads.get(b)
            windowed.update(_form(read.texel) for read in (read_a, read_b) if read is not None)
            base, offset = _offset(q)
            spare = read_b is not None and isinstance(read_b.texel, kir.Call) and read_b.texel.function == "min" \
                and _offset(read_b.texel.args[0]) == (base, offset + 1) and read_b.texel.args[1] == kir.const(last)
            if read_a is None or read_b is None or (read_a.argument, _offset(read_a.texel)) != (image.argument,
                                                                                             (base, offset)) \
                    or read_b.argument != image.argument or not (_offset(read_b.texel) == (base, offset + 1) or spare):
                misreads.append(f"{kernel.name}: {window} of {read_a}, {read_b}")
    return misreads, forms, windowed


def _windows(kernels: list[Any], function: str) -> list[kir.Call]:
    """The calls of `function` (WINDOW, window4) on two texels read into variables, at a runtime shift."""
    found = []
    for call in (call for kernel in kernels for call in of_type(kernel, kir.Call) if call.function == function):
        pair = call.args[1:3] if function == "WINDOW" else call.args[:2]
        named = [arg.kind if isinstance(arg, kir.Var) else "" for arg in (*pair, call.args[-1])]
        if named == ["T", "T", "s"]:
            found.append(call)
    return found


def test_a_window_at_a_runtime_shift_is_one_load_in_buffers(tmp_path) -> None:
    """A temporal conv's input gradient reads 3-tap weight rows at a runtime shift: images shuffle the two
    texels (window4), buffers load the window from the texel's index (a vload4, within the texel of
    slack LocalRunner leaves past each buffer; oclgrind's "shared sums in buffers" checks every access).
    Reads that masks may take outside the tensor are clamped, so their texels keep the shuffle; a
    cluster's spare last texel (min, past the end at shift 0 only) is the load's slack. A 3x3 conv's rows
    (two texel columns a work-item) shuffle texels read clamped, and window plain and spare ones. Under the
    local profile at a GPU's 64 accumulator floats: its own 128 give the temporal case wider tiles whose
    weight rows start at whole texels."""
    from tests.test_kernels_contraction import OPTIONS, TILE_CASES, write_case

    target = profile_with(str(tmp_path), "local", private_floats=64)
    kernels: dict[str, list[Any]] = {}
    for name in ("conv3x3_rows_two_columns", "conv_temporal_weight_grad_shared"):
        nodes, inits, _ = TILE_CASES[name]
        path = write_case(str(tmp_path / f"{name}.onnx"), nodes, inits)
        compile_model(path, str(tmp_path / name), target, "fp32", OPTIONS)
        plan = json.loads((tmp_path / name / "plan.json").read_text())
        texels = {t["id"]: -(-int(np.prod(t["shape"])) // 4) for t in plan["textures"]}
        kernels[name] = lowered_kernels(path, target, "fp32", OPTIONS)
        windows = [call for call in _windows(kernels[name], "WINDOW")
                   if isinstance(call.args[0], kir.ArgumentRef) and _offset(call.args[3])[0].kind == "q"]
        assert windows, name
        misreads, forms, windowed = window_misreads(kernels[name], texels)
        assert not misreads, misreads
        assert set(forms) == {"plain", "clamp", "min"}, forms  # a new form: make window_misreads see it
        assert windowed["plain"] and windowed["min"], windowed
    assert _windows(kernels["conv3x3_rows_two_columns"], "window4"), "the rows case should shuffle texels read clamped"
    rows = verify_model(str(tmp_path / "conv_temporal_weight_grad_shared.onnx"), OPTIONS, target=target,
                        storage="buffer")
    assert rows and not [r.name for r in rows if not r.ok]


def test_an_element_read_is_one_float_load_in_buffers() -> None:
    """Lane x & 3 of texel x >> 2 (a row-path MatMul's transposed operand, an elementwise broadcast): buffers of
    floats address the element itself, images (and a half buffer, a clamped texel, another lane) keep the texel and
    lane_f. PoCL: ViT's attention weight gradients 0.74 -> 0.44 ms (benchmarks/launch_times.py)."""
    from fblc.codegen.render.opencl import BUFFER, IMAGE, Renderer

    x = kir.Var("e", 7, kir.INT)
    floats, halfs = (kir.Argument("in", 0, "float", element, flat_layout(4, 64)) for element in ("float4", "half"))
    read = kir.Lane(kir.Load(floats, x >> 2), x & 3)
    assert Renderer(storage=BUFFER).expr(read) == "((__global const float*)in0)[e7]"
    assert Renderer(storage=IMAGE).expr(read).startswith("lane_f(read_imagef(in0")
    for kept in (kir.Lane(kir.Load(halfs, x >> 2), x & 3), kir.Lane(kir.Load(floats, kir.call("min", x >> 2, 9)), x & 3),
                 kir.Lane(kir.Load(floats, x >> 2), (x + 1) & 3)):
        assert Renderer(storage=BUFFER).expr(kept).startswith("lane_f("), kept
