"""params.bin written piece by piece (codegen/params.py) and weights read piece by piece (compiler/weight_data.py).

The streamed packing is checked against texel_layout.pack byte for byte over flat, R-Tile (both packings and
arrangements, padding included) and mask layouts in both float formats, with pieces far smaller than a
texture; the writer's offsets, bytes and sha256 against a plain concatenation; external data against the
numpy array it was saved from, its mapping given back after the write.
"""

from __future__ import annotations

import hashlib
import itertools
import os

import numpy as np
import onnx
import onnx_ir as ir
import pytest
from onnx import TensorProto, helper, numpy_helper

from fblc.codegen.params import ALIGN, PackedConstant, ParamsFile, source_texels
from fblc.compiler.model_io import load_model
from fblc.compiler.quantize import INT_FORMATS, pack_words, packed_words
from fblc.compiler.weight_data import equal_data, fingerprint, is_hole, value_range
from fblc.texel_layout import flat_layout, mask_layout, pack, rtile_layout


def _constant(array: np.ndarray, name: str = "w") -> ir.Value:
    return ir.Value(name=name, const_value=ir.tensor(array))


@pytest.mark.parametrize("packing", ["block", "strip"])
def test_streamed_packing_is_pack_byte_for_byte(packing: str) -> None:
    rng = np.random.default_rng(0)
    for rows, cols, tile_h, tile_w, max_width in itertools.product([5, 33], [12, 64], [1, 4], [4, 16], [3, 16]):
        array = rng.standard_normal((rows, cols)).astype(np.float32) * 1e5
        value = _constant(array)
        for layout in (rtile_layout(rows, cols, tile_h, tile_w, packing, max_width),
                       flat_layout(rows * cols // 4, max_width)):
            for dtype in (np.dtype(np.float32), np.dtype(np.float16)):
                contents, want = PackedConstant(value, layout, dtype), pack(array, layout, dtype)
                for budget in (16, 200):  # a few texels, or an image row or two, at a time
                    pieces = list(contents.pieces(budget))
                    bound = max(budget, layout.width * 4 * dtype.itemsize)  # R-Tile: whole image rows
                    assert max(p.nbytes for p in pieces) <= bound and (len(pieces) > 1 or want.nbytes <= bound)
                    assert np.array_equal(np.concatenate(pieces), want), (layout, budget)
                assert contents.nbytes == want.nbytes
    rtile = rtile_layout(33, 12, 4, 4, packing, 3)
    assert rtile.arrangement == "columns" and (source_texels(rtile, 0, rtile.height) < 0).any()  # both reached


def test_quantized_words_are_packed_in_pieces() -> None:
    # int4 and int8 weights: pack(pack_words(q)) piece by piece, a piece of whole words bounded by the budget
    rng = np.random.default_rng(2)
    for dtype, bits in ((ir.DataType.INT4, 4), (ir.DataType.INT8, 8)):
        q = rng.integers(-8, 8, (37, 11)).astype(np.int8)
        value = ir.Value(name="w.q", const_value=ir.tensor(q.astype(INT_FORMATS[dtype].numpy), dtype=dtype))
        layout = flat_layout(-(-packed_words(q.size, bits) // 4), 8)
        want = pack(pack_words(q, bits).view(np.int32), layout, np.int32)
        pieces = list(PackedConstant(value, layout, np.dtype(np.int32), bits).pieces(budget=16))
        assert max(p.nbytes for p in pieces) <= 16 and np.array_equal(np.concatenate(pieces), want), bits


def test_masks_and_small_contents_are_packed_whole() -> None:
    bits = (np.arange(100) % 3 == 0).astype(np.float32)
    layout = mask_layout("mask8", bits.size, 16, 16, pair_stride=2)
    assert np.array_equal(PackedConstant(_constant(bits), layout, np.dtype(np.uint8)).array(),
                          pack(bits, layout, np.dtype(np.uint8)))


def test_params_file_aligns_hashes_and_bounds_its_pieces(tmp_path) -> None:
    rng = np.random.default_rng(1)
    arrays = {0: rng.standard_normal(10).astype(np.float32), 3: rng.standard_normal((40, 8)).astype(np.float32)}
    contents = {i: PackedConstant(_constant(a), flat_layout(-(-a.size // 4), 8), np.dtype(np.float32))
                for i, a in arrays.items()}
    params = ParamsFile(contents)
    digest = params.write_to(str(tmp_path / "params.bin"))
    data = (tmp_path / "params.bin").read_bytes()
    assert digest == hashlib.sha256(data).hexdigest()
    for texture_id, (offset, nbytes) in params.offsets.items():
        assert offset % ALIGN == 0
        want = pack(arrays[texture_id], contents[texture_id].layout, np.dtype(np.float32))
        assert data[offset:offset + nbytes] == want.tobytes()
    assert len(data) == max(o + n for o, n in params.offsets.values())
    assert max(p.nbytes for p in contents[3].pieces(budget=256)) <= 256


@pytest.mark.parametrize("direct", [True, False])
def test_params_file_written_in_direct_blocks_is_the_streamed_file(tmp_path, monkeypatch, direct: bool) -> None:
    # write_to (blocks written with O_DIRECT, or plainly where there is none) gives the chunks' bytes and sha256:
    # several whole blocks, then a last one that is not a whole page (padded for O_DIRECT, cut back)
    if not direct:
        monkeypatch.delattr(os, "O_DIRECT", raising=False)
    rng = np.random.default_rng(3)
    arrays = {1: rng.standard_normal((40, 100)).astype(np.float32), 2: rng.standard_normal(7).astype(np.float32)}
    params = ParamsFile({i: PackedConstant(_constant(a), flat_layout(-(-a.size // 4), 8), np.dtype(np.float32))
                         for i, a in arrays.items()})
    streamed = b"".join(bytes(chunk) for chunk in params.chunks())
    path = tmp_path / "params.bin"
    assert params.write_to(str(path), block=4096) == hashlib.sha256(streamed).hexdigest()
    assert path.read_bytes() == streamed and len(streamed) % 4096
    monkeypatch.setattr(os, "write", lambda fd, data: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    for block in (4096, 1 << 15):  # a whole block fails, or the one padded last block (a map of its own)
        with pytest.raises(OSError, match="No space left"):  # the disk's error, as write_bundle reports it
            params.write_to(str(path), block=block)


def test_external_weights_stream_from_their_mapping_and_are_given_back(tmp_path) -> None:
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
                              [numpy_helper.from_array(weight, "w")])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(graph), path, save_as_external_data=True, location="m.onnx.data",
              size_threshold=0)
    value = load_model(path).graph.initializers["w"]
    tensor = value.const_value
    assert isinstance(tensor, ir.ExternalTensor) and not is_hole(tensor)
    layout = rtile_layout(64, 32, 4, 8, "block", 16)
    got = np.concatenate(list(PackedConstant(value, layout, np.dtype(np.float32)).pieces(budget=512)))
    assert np.array_equal(got, pack(weight, layout, np.dtype(np.float32)))
    assert tensor.raw is None  # unmapped after the write: its pages are no longer the process's
    assert value_range(tensor) == (weight.min().item(), weight.max().item())
    assert fingerprint(tensor) == fingerprint(ir.tensor(np.ascontiguousarray(weight.T)))
    assert equal_data(tensor, ir.tensor(np.ascontiguousarray(weight.T)), transposed=True)
    assert not equal_data(tensor, ir.tensor(weight + 1), transposed=False)


def test_a_weight_in_a_sparse_files_hole_is_zeros_unread(tmp_path) -> None:
    data = tmp_path / "sparse.data"
    with open(data, "wb") as handle:
        handle.truncate(1 << 22)
        handle.seek(1 << 21)
        handle.write(b"\1" * 4096)
    hole = ir.ExternalTensor("sparse.data", 0, 1 << 20, ir.DataType.FLOAT, shape=ir.Shape([1 << 18]), name="h",
                             base_dir=str(tmp_path))
    written = ir.ExternalTensor("sparse.data", 1 << 21, 4096, ir.DataType.FLOAT, shape=ir.Shape([1024]), name="d",
                                base_dir=str(tmp_path))
    if os.lseek(os.open(data, os.O_RDONLY), 0, os.SEEK_DATA) != 0:  # the filesystem reports holes
        assert is_hole(hole)
    assert not is_hole(written) and value_range(hole) == (0.0, 0.0)
    square = np.arange(16, dtype=np.float32).reshape(4, 4)
    assert fingerprint(ir.tensor(square)) == fingerprint(ir.tensor(np.ascontiguousarray(square.T)))
    assert fingerprint(ir.tensor(square)) != fingerprint(ir.tensor(square + 1))
    assert np.isnan(value_range(ir.tensor(np.array([1.0, np.nan, 2.0], np.float32)))[0])
