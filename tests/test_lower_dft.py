"""lower_dft: DFT and STFT as MatMul / Conv by constant cosine/sine matrices.

Graph mode: each DFT form (real and complex input, inverse, onesided, dft_length truncating and
padding, opset 17's axis attribute and opset 20's axis input) lowered and run in onnxruntime
against numpy's FFT; STFT against torch.stft; real dynamo exports of torch.fft.rfft / fft / ifft /
irfft and torch.stft (center=False, and the default center=True: a reflect Pad; log magnitude)
inside a model with trainable weights, one SGD step against torch autograd. The legacy exporter refuses every torch.fft function and a complex STFT
(`aten::fft_rfft ... is not supported`); it writes torch.stft(return_complex=False) as STFT of a
[batch, length] signal, trained here too. transformers' FNet is in the zoo (tests/support/zoo.py).
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper

from fblc.errors import UnsupportedOpError
from fblc.passes.lower_dft import MAX_MATRIX_ELEMENTS, LowerDft
from support import zoo, zoo_check

# (input shape, opset, inverse, onesided, dft_length or None, axis)
FORMS = [
    ((2, 8, 1), 17, 0, 1, None, 1),  # rfft
    ((2, 8, 2), 17, 0, 0, None, 1),  # fft
    ((2, 8, 2), 17, 1, 0, None, 1),  # ifft
    ((2, 5, 2), 17, 1, 1, 8, 1),  # irfft, even n
    ((2, 5, 2), 20, 1, 1, None, -2),  # irfft, default n = 2 (L - 1), axis input
    ((2, 5, 2), 20, 1, 1, 7, 1),  # irfft, odd n: reads 4 of 5 bins (onnxruntime's own DFT is off by 0.6 here)
    ((2, 3, 2), 17, 1, 1, 8, 1),  # irfft, bins 3 and 4 zero-padded
    ((3, 6, 4, 1), 20, 0, 1, 9, 1),  # rfft zero-padded, axis not last: Transpose around
    ((3, 6, 4, 2), 20, 0, 0, 3, -3),  # fft truncated (Slice), negative axis
    ((3, 6, 4, 2), 17, 1, 0, 5, 2),  # ifft zero-padded
    ((2, 7, 1), 20, 0, 0, None, -2),  # a real input's full spectrum, odd n
]


def _dft_model(shape: tuple[int, ...], opset: int, inverse: int, onesided: int, n: int | None,
               axis: int) -> ir.Model:
    inputs, initializers, attributes = ["x", "n" if n is not None else ""], [], {"inverse": inverse,
                                                                             "onesided": onesided}
    if n is not None:
        initializers.append(helper.make_tensor("n", TensorProto.INT64, [], [n]))
    if opset >= 20:
        inputs.append("axis")
        initializers.append(helper.make_tensor("axis", TensorProto.INT64, [], [axis]))
    else:
        attributes["axis"] = axis
    while not inputs[-1]:
        inputs.pop()  # no trailing empty input
    node = helper.make_node("DFT", inputs, ["y"], name="dft", **attributes)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], initializers)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)]))


def _numpy_dft(x: np.ndarray, inverse: int, onesided: int, n: int | None, axis: int) -> np.ndarray:
    axis %= x.ndim
    z = x[..., 0] + (1j * x[..., 1] if x.shape[-1] == 2 else 0)
    if inverse and onesided:
        return np.fft.irfft(z, n or 2 * (z.shape[axis] - 1), axis=axis)[..., None]
    n = n or z.shape[axis]
    y = np.fft.ifft(z, n, axis=axis) if inverse else np.fft.fft(z, n, axis=axis)
    if onesided:
        y = np.take(y, range(n // 2 + 1), axis=axis)
    return np.stack([y.real, y.imag], -1)


def _run(model: ir.Model, feeds: dict[str, np.ndarray]) -> np.ndarray:
    session = ort.InferenceSession(ir.to_proto(model).SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, feeds)[0]


@pytest.mark.parametrize("form", FORMS, ids=[f"{s}-op{o}-inv{i}-one{h}-n{n}-ax{a}" for s, o, i, h, n, a in FORMS])
def test_dft_forms_match_numpy(form) -> None:
    shape, opset, inverse, onesided, n, axis = form
    model = _dft_model(*form)
    assert LowerDft()(model).modified
    assert not {"DFT"} & {node.op_type for node in model.graph}
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    want = _numpy_dft(x.astype(np.float64), inverse, onesided, n, axis)
    np.testing.assert_allclose(_run(model, {"x": x}), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_irfft_gives_dc_and_nyquist_imaginary_parts_exactly_zero_weight() -> None:
    """numpy and torch ignore them (a real signal's spectrum has none): the matrix rows are exact zeros."""
    model = _dft_model((1, 5, 2), 17, 1, 1, 8, 1)
    LowerDft()(model)
    matrix = next(v.const_value.numpy() for v in model.graph.initializers.values() if v.const_value.numpy().ndim == 2)
    assert matrix.shape == (10, 8) and not matrix[1].any() and not matrix[9].any()
    assert matrix[2, 0] == 0.25 and matrix[8, 1] == -0.125  # 2 / n at bin 1, 1 / n at Nyquist (cos pi)


def _stft_model(signal: tuple[int, ...], step: int, window: np.ndarray | None, onesided: int) -> ir.Model:
    """STFT of `signal` with `window`, or without one and frame_length 6."""
    constants = [helper.make_tensor("step", TensorProto.INT64, [], [step]),
                 helper.make_tensor("window", TensorProto.FLOAT, window.shape, window) if window is not None else
                 helper.make_tensor("frame_length", TensorProto.INT64, [], [6])]
    inputs = ["x", "step", "window"] if window is not None else ["x", "step", "", "frame_length"]
    node = helper.make_node("STFT", inputs, ["y"], name="stft", onesided=onesided)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, signal)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], constants)
    return ir.from_proto(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))


@pytest.mark.parametrize("onesided, channels, windowed", [(1, 1, True), (0, 1, True), (0, 2, False)])
def test_stft_matches_torch(onesided: int, channels: int, windowed: bool) -> None:
    window = torch.hann_window(6, dtype=torch.float64) if windowed else None
    model = _stft_model((2, 20, channels), 3, window.numpy().astype(np.float32) if windowed else None, onesided)
    LowerDft()(model)
    assert "Conv" in {node.op_type for node in model.graph}
    x = np.random.default_rng(1).standard_normal((2, 20, channels)).astype(np.float32)
    signal = torch.from_numpy(x).double()
    signal = torch.view_as_complex(signal) if channels == 2 else signal[..., 0]
    rectangular = torch.ones(6, dtype=torch.float64)  # what ONNX's STFT without a window applies
    want = torch.view_as_real(torch.stft(signal, 6, 3, window=rectangular if window is None else window, center=False,
                                         onesided=bool(onesided), return_complex=True)).transpose(1, 2).numpy()
    np.testing.assert_allclose(_run(model, {"x": x}), want, rtol=0, atol=2e-6 * np.abs(want).max())


def test_refusals_name_the_node() -> None:
    big = int(np.sqrt(MAX_MATRIX_ELEMENTS / 4)) + 8  # a complex DFT's matrix is (2 n)^2
    with pytest.raises(UnsupportedOpError, match=r"DFT node 'dft' needs a \d+ x \d+ cosine/sine matrix.*limit"):
        LowerDft()(_dft_model((1, big, 2), 17, 0, 0, None, 1))
    computed = _dft_model((2, 8, 1), 17, 0, 1, 8, 1)
    n_value = computed.graph.initializers["n"]
    computed.graph.initializers.pop("n")
    n_value.const_value = None
    computed.graph.inputs.append(n_value)
    with pytest.raises(UnsupportedOpError, match=r"DFT node 'dft': its dft_length \('n'\) is computed at run time"):
        LowerDft()(computed)


# --- real exports: one SGD step against torch autograd ----------------------------------------------


class Spectral(torch.nn.Module):
    """Trainable projections around every transform the dynamo exporter writes as DFT or STFT."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 8)
        self.mix = torch.nn.Linear(8 * 5 * 2 + 6 * 8 * 2 + 7 * 8 * 2 + 8 * 7 + 5 * 3 * 2 + 3 * 5, 16)
        self.out = torch.nn.Linear(16, zoo.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)  # [B, S=8, 8]
        rfft = torch.view_as_real(torch.fft.rfft(h, dim=-1))  # [B, 8, 5, 2]
        fft = torch.view_as_real(torch.fft.fft(h, n=6, dim=1))  # truncated along the sequence
        ifft = torch.view_as_real(torch.fft.ifft(torch.fft.fft(h, dim=-1), n=7, dim=1))  # complex in, padded
        irfft = torch.fft.irfft(torch.fft.rfft(h, dim=-1), n=7, dim=-1)  # odd n
        spectrogram = torch.view_as_real(torch.stft(h[:, :, 0].repeat(1, 2) * h[:, :, 1].repeat(1, 2), n_fft=8,
                                                    hop_length=4, window=torch.hann_window(8), center=False,
                                                    return_complex=True))  # [B, 5, 3, 2]
        # torch.stft's default center=True (a reflect Pad, whose gradient reaches h), log magnitude [B, 3, 5]
        front = (torch.stft(h[:, :, 2], n_fft=4, hop_length=2, window=torch.hann_window(4),
                            return_complex=True).abs() + 1e-2).log()
        features = [t.flatten(1) for t in (rfft, fft, ifft, irfft, spectrogram, front)]
        return self.out(torch.tanh(self.mix(torch.cat(features, 1))))


def _spectral() -> tuple[torch.nn.Module, zoo.Inputs]:
    torch.manual_seed(0)
    x = np.random.default_rng(6).standard_normal((zoo.BATCH, 8, 6)).astype(np.float32)
    return zoo.randomize_constant_parameters(Spectral(), seed=1).eval(), {"x": x}


def test_fft_exports_train_like_torch(tmp_path) -> None:
    arch = zoo.Architecture("spectral", "audio", "dynamo", _spectral)
    outcome = zoo_check.check(arch, str(tmp_path))
    assert outcome.ok, outcome.failure()


class LegacySpectrogram(torch.nn.Module):
    """torch.stft(return_complex=False): the legacy exporter writes it as STFT of a [batch, length] signal."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = torch.nn.Linear(6, 1)
        self.out = torch.nn.Linear(5 * 3 * 2, zoo.CLASSES)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        signal = self.inp(x)[..., 0]  # [B, 16]
        spectrogram = torch.stft(signal, 8, 4, window=torch.hann_window(8), center=False, return_complex=False)
        return self.out(spectrogram.flatten(1))


def _legacy_spectrogram() -> tuple[torch.nn.Module, zoo.Inputs]:
    torch.manual_seed(0)
    x = np.random.default_rng(7).standard_normal((zoo.BATCH, 16, 6)).astype(np.float32)
    return LegacySpectrogram().eval(), {"x": x}


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch deprecates return_complex=False
def test_a_legacy_stft_export_trains_like_torch(tmp_path) -> None:
    outcome = zoo_check.check(zoo.Architecture("legacy_stft", "audio", "legacy", _legacy_spectrogram), str(tmp_path))
    assert outcome.ok, outcome.failure()
