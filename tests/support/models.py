"""Models for the numeric tests: ONNX files from real exporters and from fblc's builders, each
with the torch module that computes the same function, one batch, and the reference loss.

Exports are cached for the test process (`session_cached`), since a dynamo export takes seconds.
Models come from transformers *configs* with random weights (never downloaded); BatchNorm
statistics and affine terms are randomised, because at their initial values (mean 0, var 1,
gamma 1, beta 0) a wrong BN gradient can still look right, and the legacy exporter would merge
the identical BN tensors into one initializer.

Parameter naming: the reference module's parameters are the torch names. An ONNX trainable
tensor links to one of them (`Link`): by name, through onnxscript's
`pkg.onnxscript.optimizer.folded_from` metadata (a pre-transposed weight), or by value
(a conv weight or bias with BatchNorm fused in, whose reference is the torch module with
the same fusion applied). Every link is checked by value.
"""

from __future__ import annotations

import atexit
import copy
import functools
import inspect
import os
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import torch
import torch.nn.functional as F

FOLDED_FROM = "pkg.onnxscript.optimizer.folded_from"
IGNORE_INDEX = -100

LossOf = Callable[[torch.nn.Module], torch.Tensor]


@dataclass
class ExportedModel:
    """An ONNX model file and its torch reference, with one batch to train on."""

    name: str
    path: str
    module: torch.nn.Module  # eval mode; copy it before training
    inputs: dict[str, np.ndarray]  # ONNX input name -> array
    labels: np.ndarray
    loss_of: LossOf  # the torch loss of `module` on this batch
    input_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)


@dataclass(frozen=True)
class Link:
    """An ONNX trainable tensor is the torch parameter `torch_name`, transposed or not."""

    torch_name: str
    transposed: bool = False

    def to_onnx(self, array: np.ndarray) -> np.ndarray:
        return np.swapaxes(array, -1, -2) if self.transposed else array

    def to_torch(self, array: np.ndarray) -> np.ndarray:
        return self.to_onnx(array)  # swapping the last two axes is its own inverse


def session_cached(build: Callable[..., Any]) -> Callable[..., Any]:
    """Memoise `build(directory, **options)` per options: one export per test process (an xdist worker), written
    to a folder of the process's own (removed at its exit), whatever folder the caller names. Keyed by the
    caller's folder, each test file (and each test that passed its tmp_path) exported again: Llama's and
    MobileNetV2's dynamo exports are 2-4 CPU s each. Callers deep-copy the torch module before training it."""
    cache: dict[tuple[tuple[str, Any], ...], Any] = {}

    @functools.wraps(build)
    def cached(directory: str | os.PathLike[str], **options: Any) -> Any:
        key = tuple(sorted(options.items()))
        if key not in cache:
            cache[key] = build(_export_folder(), **options)
        return cache[key]

    return cached


@functools.cache
def _export_folder() -> str:
    folder = tempfile.mkdtemp(prefix="fblc-test-exports-")
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    return folder


# --- helpers --------------------------------------------------------------------------------


def randomize_batch_norm(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every BatchNorm non-trivial running statistics, gamma and beta (in place)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for sub in module.modules():
            if isinstance(sub, torch.nn.modules.batchnorm._BatchNorm):
                sub.weight.uniform_(0.5, 1.5, generator=generator)
                sub.bias.normal_(0.0, 0.1, generator=generator)
                sub.running_mean.normal_(0.0, 0.1, generator=generator)
                sub.running_var.uniform_(0.5, 1.5, generator=generator)
    return module


def randomize_norm_weights(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Give every RMSNorm/LayerNorm weight distinct values (in place).

    At their initial ones, all norm weights are equal, and onnxscript's optimizer merges
    equal initializers into one tensor, which would then train as one shared parameter.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            if "norm" in name.rsplit(".", 2)[-2] and name.endswith("weight"):
                param.uniform_(0.5, 1.5, generator=generator)
    return module


def logits_only(model: torch.nn.Module, input_name: str, **fixed: Any) -> torch.nn.Module:
    """Make a transformers model return its logits tensor only, keeping its parameter names.

    The class is swapped for a subclass rather than wrapped in a module, so that the
    exported initializers are the model's own torch names (no `model.` prefix).
    """
    base = type(model)

    def forward(self: torch.nn.Module, tensor: torch.Tensor) -> torch.Tensor:
        return base.forward(self, **{input_name: tensor}, **fixed).logits

    # torch.export names the graph input after the forward's parameter
    forward.__signature__ = inspect.Signature([  # type: ignore[attr-defined]
        inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        inspect.Parameter(input_name, inspect.Parameter.POSITIONAL_OR_KEYWORD)])
    model.__class__ = type(base.__name__, (base,), {"forward": forward})
    return model


def classification_loss(forward: Callable[[torch.nn.Module], torch.Tensor], labels: np.ndarray) -> LossOf:
    target = torch.from_numpy(labels)
    return lambda module: F.cross_entropy(forward(module), target, ignore_index=IGNORE_INDEX)


def causal_lm_loss(ids: np.ndarray) -> tuple[np.ndarray, LossOf]:
    """Labels for next-token prediction (last position ignored) and HF's loss on logits."""
    labels = np.full_like(ids, IGNORE_INDEX)
    labels[:, :-1] = ids[:, 1:]
    tokens = torch.from_numpy(ids)

    def loss_of(module: torch.nn.Module) -> torch.Tensor:
        logits = module(tokens)
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1))

    return labels, loss_of


def _quiet_dynamo_export(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> Any:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(module, args, dynamo=True, optimize=False, opset_version=18, verbose=False)


# --- transformers models ---------------------------------------------------------------------


def export_mobilenet_v2(path: str, pixels: np.ndarray, num_labels: int, image_size: int) -> torch.nn.Module:
    """HF MobileNetV2 (torch seed 0, default BatchNorm) exported by dynamo on `pixels` to `path`; the module."""
    import transformers

    torch.manual_seed(0)
    module = logits_only(transformers.MobileNetV2ForImageClassification(
        transformers.MobileNetV2Config(num_labels=num_labels, image_size=image_size)), "pixel_values").eval()
    _quiet_dynamo_export(module, (torch.from_numpy(pixels),)).save(path)
    return module


@session_cached
def mobilenet_v2(directory: str) -> ExportedModel:
    """HF MobileNetV2 (17 classes, image 97) on [2, 3, 97, 60], dynamo export, BN kept."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MobileNetV2Config(num_labels=17, image_size=97)
    model = transformers.MobileNetV2ForImageClassification(config)
    model = logits_only(randomize_batch_norm(model, seed=1), "pixel_values").eval()
    rng = np.random.default_rng(0)
    pixels = rng.standard_normal((2, 3, 97, 60)).astype(np.float32)
    labels = rng.integers(0, 17, size=(2,)).astype(np.int64)
    path = os.path.join(directory, "mobilenet_v2.onnx")
    _quiet_dynamo_export(model, (torch.from_numpy(pixels),)).save(path)
    return ExportedModel("mobilenet_v2", path, model, {"pixel_values": pixels}, labels,
                         classification_loss(lambda m: m(torch.from_numpy(pixels)), labels))


def _small_resnet() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                       layer_type="basic", num_labels=10)
    model = transformers.ResNetForImageClassification(config)
    return logits_only(randomize_batch_norm(model, seed=2), "pixel_values").eval()


def _resnet_batch() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    pixels = rng.standard_normal((2, 3, 32, 32)).astype(np.float32)
    labels = rng.integers(0, 10, size=(2,)).astype(np.int64)
    return pixels, labels


@session_cached
def resnet_legacy(directory: str) -> ExportedModel:
    """A tiny HF ResNet (basic blocks) from the legacy TorchScript exporter, BN and torch names kept."""
    model = _small_resnet()
    pixels, labels = _resnet_batch()
    return _legacy_image_classifier("resnet_legacy", model, pixels, labels, directory)


def _legacy_image_classifier(name: str, model: torch.nn.Module, pixels: np.ndarray, labels: np.ndarray,
                             directory: str) -> ExportedModel:
    """`model` on `pixels` through the legacy TorchScript exporter, BatchNorm and torch names kept."""
    path = os.path.join(directory, f"{name}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.from_numpy(pixels),), path, dynamo=False, do_constant_folding=False,
                          opset_version=18, input_names=["pixel_values"], output_names=["logits"])
    return ExportedModel(name, path, model, {"pixel_values": pixels}, labels,
                         classification_loss(lambda m: m(torch.from_numpy(pixels)), labels))


def fuse_conv_batch_norm(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of an HF ResNet with each conv's BatchNorm folded into it (as onnxscript's optimizer does).

    The fused conv gets a bias; the reference for a BN-fused ONNX model must train exactly
    these tensors, since that is what the ONNX file holds.
    """
    from torch.nn.utils.fusion import fuse_conv_bn_eval

    fused = copy.deepcopy(model)
    for sub in fused.modules():
        conv, norm = getattr(sub, "convolution", None), getattr(sub, "normalization", None)
        if isinstance(conv, torch.nn.Conv2d) and isinstance(norm, torch.nn.BatchNorm2d):
            sub.convolution = fuse_conv_bn_eval(conv, norm)
            sub.normalization = torch.nn.Identity()
    for param in fused.parameters():  # torch makes a conv's new bias with requires_grad False
        param.requires_grad_(True)
    return fused.eval()


class SmallConvNet(torch.nn.Module):
    """The conv families of mobile nets in one small module: a strided stem, depthwise, pointwise
    and grouped convolutions with BatchNorm and ReLU6, a residual, max and average pools, a head."""

    def __init__(self) -> None:
        super().__init__()
        nn = torch.nn
        self.stem, self.stem_bn = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(8)
        self.depthwise, self.depthwise_bn = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False), nn.BatchNorm2d(8)
        self.pointwise, self.pointwise_bn = nn.Conv2d(8, 12, 1, bias=False), nn.BatchNorm2d(12)
        self.grouped = nn.Conv2d(12, 12, 3, padding=1, groups=3)
        self.max_pool, self.avg_pool = nn.MaxPool2d(3, stride=2, padding=1), nn.AvgPool2d(2)
        self.head = nn.Linear(12, 5)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        x = F.relu6(self.stem_bn(self.stem(pixels)))
        x = F.relu6(self.depthwise_bn(self.depthwise(x)))
        x = self.pointwise_bn(self.pointwise(x))
        x = self.avg_pool(self.max_pool(x + F.relu(self.grouped(x))))
        return self.head(x.mean(dim=(2, 3)))


@session_cached
def small_convnet(directory: str) -> ExportedModel:
    """SmallConvNet on [2, 3, 16, 16] from the legacy exporter, BatchNorm kept."""
    torch.manual_seed(5)
    model = randomize_batch_norm(SmallConvNet(), seed=5).eval()
    rng = np.random.default_rng(5)
    pixels = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    labels = rng.integers(0, 5, size=(2,)).astype(np.int64)
    return _legacy_image_classifier("small_convnet", model, pixels, labels, directory)


@session_cached
def resnet_dynamo_optimized(directory: str) -> ExportedModel:
    """The tiny ResNet from the dynamo exporter with onnxscript's optimizer (BN fused into the convs)."""
    model = _small_resnet()
    pixels, labels = _resnet_batch()
    path = os.path.join(directory, "resnet_dynamo_opt.onnx")
    program = _quiet_dynamo_export(model, (torch.from_numpy(pixels),))
    program.optimize()  # what export(optimize=True) runs
    program.save(path)
    reference = fuse_conv_batch_norm(model)
    return ExportedModel("resnet_dynamo_opt", path, reference, {"pixel_values": pixels}, labels,
                         classification_loss(lambda m: m(torch.from_numpy(pixels)), labels))


@session_cached
def llama(directory: str, layers: int = 2) -> tuple[ExportedModel, ExportedModel]:
    """A Llama of `layers` decoder layers (RMSNorm, rotary, grouped-query attention), logits only, dynamo export.

    One trace serves both files: the unoptimised export, then the same program after
    `optimize()` (what export(optimize=True) runs), which pre-transposes the weights.
    """
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = randomize_norm_weights(transformers.LlamaForCausalLM(config), seed=3)
    model = logits_only(model, "input_ids", use_cache=False).eval()
    rng = np.random.default_rng(2)
    ids = rng.integers(0, config.vocab_size, size=(2, 16)).astype(np.int64)
    labels, loss_of = causal_lm_loss(ids)
    program = _quiet_dynamo_export(model, (torch.from_numpy(ids),))
    stem = "llama" if layers == 2 else f"llama_{layers}_layers"
    plain = os.path.join(directory, f"{stem}.onnx")
    program.save(plain)
    program.optimize()
    optimized = os.path.join(directory, f"{stem}_opt.onnx")
    program.save(optimized)
    return (ExportedModel("llama", plain, model, {"input_ids": ids}, labels, loss_of),
            ExportedModel("llama_opt", optimized, model, {"input_ids": ids}, labels, loss_of))


# --- fblc's own builders, with independent torch references ----------------------------------


def onnx_initializers(path: str) -> dict[str, np.ndarray]:
    model = onnx.load(path)
    return {t.name: onnx.numpy_helper.to_array(t).copy() for t in model.graph.initializer}


def _load_named(module: torch.nn.Module, arrays: Mapping[str, np.ndarray]) -> torch.nn.Module:
    """Load ONNX initializers into `module` by name; every parameter and buffer must be found."""
    state = {name: torch.from_numpy(array) for name, array in arrays.items()}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("num_batches_tracked")]
    assert not missing and not unexpected, f"missing {missing}, unexpected {unexpected}"
    return module


class TorchMLP(torch.nn.Module):
    """Reference for examples/mlp.py: Linear layers with ReLU between them.

    A layer whose weight the ONNX graph feeds to Gemm stores it [out, in] (y = x W^T + b);
    one fed to MatMul stores it [in, out] (y = x W + b).
    """

    def __init__(self, weights: Sequence[np.ndarray], gemm: Sequence[bool]) -> None:
        super().__init__()
        self.gemm = list(gemm)
        self.layers = torch.nn.ModuleList()
        for weight, uses_gemm in zip(weights, gemm):
            layer = torch.nn.Module()
            layer.weight = torch.nn.Parameter(torch.empty(weight.shape))
            layer.bias = torch.nn.Parameter(torch.empty(weight.shape[0] if uses_gemm else weight.shape[1]))
            self.layers.append(layer)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, (layer, uses_gemm) in enumerate(zip(self.layers, self.gemm)):
            x = F.linear(x, layer.weight, layer.bias) if uses_gemm else x @ layer.weight + layer.bias
            if index < len(self.layers) - 1:
                x = torch.relu(x)
        return x

    @classmethod
    def from_onnx(cls, path: str) -> "TorchMLP":
        graph = onnx.load(path).graph
        arrays = onnx_initializers(path)
        consumers = {n.input[1]: n.op_type for n in graph.node if n.op_type in ("Gemm", "MatMul")}
        count = len(consumers)
        weights = [arrays[f"layers.{i}.weight"] for i in range(count)]
        gemm = [consumers[f"layers.{i}.weight"] == "Gemm" for i in range(count)]
        return _load_named(cls(weights, gemm), arrays).eval()


class _TemporalBlock(torch.nn.Module):
    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        for index, kernel in enumerate((8, 5, 3), start=1):
            setattr(self, f"conv{index}", torch.nn.Conv2d(c_in if index == 1 else c_out, c_out, (kernel, 1),
                                                          padding="same"))
            setattr(self, f"bn{index}", torch.nn.BatchNorm2d(c_out, eps=1e-5))
        self.shortcut: torch.nn.Module | None = None
        if c_in != c_out:
            self.shortcut = torch.nn.Module()
            self.shortcut.conv = torch.nn.Conv2d(c_in, c_out, 1)
            self.shortcut.bn = torch.nn.BatchNorm2d(c_out, eps=1e-5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        h = torch.relu(self.bn2(self.conv2(h)))
        h = self.bn3(self.conv3(h))
        shortcut = x if self.shortcut is None else self.shortcut.bn(self.shortcut.conv(x))
        return torch.relu(shortcut + h)


class TorchTResNet(torch.nn.Module):
    """Reference for examples/tresnet.py, written from the architecture, not from the builder."""

    def __init__(self, channels: int, classes: int, maps: Sequence[int] = (64, 128, 128)) -> None:
        super().__init__()
        widths = [channels, *maps]
        self.blocks = torch.nn.ModuleList(_TemporalBlock(a, b) for a, b in zip(widths[:-1], widths[1:]))
        self.fc = torch.nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.fc(x.mean(dim=(2, 3)))

    @classmethod
    def from_onnx(cls, path: str) -> "TorchTResNet":
        arrays = onnx_initializers(path)
        channels = arrays["blocks.0.conv1.weight"].shape[1]
        classes = arrays["fc.weight"].shape[0]
        return _load_named(cls(channels, classes), arrays).eval()


def _example(name: str) -> Callable[..., str]:
    """A builder function from examples/, imported by path (examples/ is not a package)."""
    import importlib.util

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    spec = importlib.util.spec_from_file_location(f"fblc_example_{name}", os.path.join(root, "examples", f"{name}.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, f"build_{name}")


@session_cached
def mlp(directory: str) -> ExportedModel:
    path = _example("mlp")(os.path.join(directory, "mlp.onnx"))
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 32)).astype(np.float32)
    labels = rng.integers(0, 10, size=(8,)).astype(np.int64)
    labels[5] = IGNORE_INDEX  # an ignored sample: the loss averages over the other 7
    module = TorchMLP.from_onnx(path)
    return ExportedModel("mlp", path, module, {"x": x}, labels,
                         classification_loss(lambda m: m(torch.from_numpy(x)), labels))


@session_cached
def tresnet(directory: str) -> ExportedModel:
    path = _example("tresnet")(os.path.join(directory, "tresnet.onnx"))
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 97, 60, 1)).astype(np.float32)
    labels = rng.integers(0, 17, size=(4,)).astype(np.int64)
    module = TorchTResNet.from_onnx(path)
    return ExportedModel("tresnet", path, module, {"x": x}, labels,
                         classification_loss(lambda m: m(torch.from_numpy(x)), labels))


# --- linking ONNX trainables to torch parameters ----------------------------------------------


def _folded_sources(value: ir.Value) -> list[str]:
    text = value.metadata_props.get(FOLDED_FROM)
    if not text:
        return []
    import ast

    return list(ast.literal_eval(text))


def _matches(onnx_array: np.ndarray, torch_array: np.ndarray, transposed: bool) -> bool:
    candidate = np.swapaxes(torch_array, -1, -2) if transposed and torch_array.ndim >= 2 else torch_array
    if transposed and torch_array.ndim < 2:
        return False
    return candidate.shape == onnx_array.shape and np.allclose(candidate, onnx_array, rtol=1e-5, atol=1e-6)


def link_parameters(model_path: str, names: Sequence[str], module: torch.nn.Module) -> dict[str, Link]:
    """Link each ONNX trainable tensor in `names` to the torch parameter it is, checked by value.

    Order of evidence: the same name; onnxscript's folded_from metadata naming one
    parameter; otherwise the unique parameter of equal value (plain or transposed). Raises
    AssertionError when a tensor links to nothing or to more than one parameter.
    """
    graph = ir.load(model_path).graph
    params = {name: p.detach().numpy() for name, p in module.named_parameters()}
    links: dict[str, Link] = {}
    for name in names:
        value = graph.initializers[name]
        array = value.const_value.numpy()
        candidates = [name] if name in params else [s for s in _folded_sources(value) if s in params]
        if not candidates:
            candidates = list(params)
        found = [Link(c, t) for c in candidates
                 for t in ((False,) if _matches(array, params[c], False) else (True,)) if _matches(array, params[c], t)]
        assert len(found) == 1, f"ONNX tensor '{name}' links to {found or 'no torch parameter'}"
        links[name] = found[0]
    return links


def load_linked(module: torch.nn.Module, links: Mapping[str, Link], arrays: Mapping[str, np.ndarray]) -> None:
    """Copy the ONNX values into the linked torch parameters, so both sides start bit-equal."""
    params = dict(module.named_parameters())
    with torch.no_grad():
        for name, link in links.items():
            params[link.torch_name].copy_(torch.from_numpy(np.ascontiguousarray(link.to_torch(arrays[name]))))
