"""memory_floor (MemFLoRA adapters), sg_gradients and sg_replay: golden, leave-alone, numeric, errors.

The PyTorch references below are written from the paper (MemFLoRA, eq. 8): at an adapter site
y = act(BN_eval(W x) + a_s * U(P x)), with P a frozen 1x1 projection and U a trainable conv of
the base conv's geometry; autograd differentiates it as it likes (it saves x, fblc must not).
"""

from __future__ import annotations

import copy
import json
import os
import types

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper

from fblc.compiler import keys
from fblc.compiler.adapters import AdapterConfig
from fblc.errors import FblcError
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OptimizerConfig
from fblc.compiler.reference import ReferenceStep
from fblc.passes.memory_floor import MemoryFloor
from fblc.passes.pipeline import TrainingOptions, build_training_graph, import_passes, run_passes
from support import models
from tests.conftest import make_model, mlp_proto

RTOL, ATOL = 1e-4, 1e-5  # fp32 both sides, different summation order
ADAM = OptimizerConfig(name="adam", lr=1e-3, weight_decay=5e-4)

pytestmark = pytest.mark.filterwarnings("ignore:Using padding='same' with even kernel:UserWarning")


def run_onnx(model: ir.Model, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    return ort.InferenceSession(ir.to_proto(model).SerializeToString(), options).run(None, feeds)


def conv_bn_relu6_proto(groups: int = 1, bn: bool = True, channels: int = 4) -> onnx.ModelProto:
    """x [2, 3, 6, 5] -> Conv 3x3 (pads 1) -> [BatchNorm] -> Clip(0, 6) -> GlobalAveragePool -> Flatten."""
    rng = np.random.default_rng(7)
    c_in = 3 if groups == 1 else channels
    nodes = [helper.make_node("Conv", ["x", "conv.weight", "conv.bias"], ["c"], pads=[1, 1, 1, 1], group=groups,
                              name="conv")]
    last = "c"
    inits = {"conv.weight": rng.standard_normal((channels, c_in // groups, 3, 3)).astype(np.float32),
             "conv.bias": rng.standard_normal(channels).astype(np.float32),
             "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    if bn:
        nodes.append(helper.make_node("BatchNormalization", ["c", "bn.weight", "bn.bias", "bn.mean", "bn.var"], ["b"],
                                      name="bn"))
        inits.update({"bn.weight": rng.uniform(0.5, 1.5, channels).astype(np.float32),
                      "bn.bias": rng.normal(0, 0.1, channels).astype(np.float32),
                      "bn.mean": rng.normal(0, 0.1, channels).astype(np.float32),
                      "bn.var": rng.uniform(0.5, 1.5, channels).astype(np.float32)})
        last = "b"
    nodes += [helper.make_node("Clip", [last, "lo", "hi"], ["a"], name="relu6"),
              helper.make_node("GlobalAveragePool", ["a"], ["p"], name="pool"),
              helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, c_in, 6, 5])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, channels])], inits)


def imported(proto: onnx.ModelProto) -> ir.Model:
    return run_passes(ir.from_proto(proto), import_passes(TrainingOptions()))


# golden / leave alone ----------------------------------------------------------------------------

def test_memory_floor_golden_conv_bn_relu6() -> None:
    model = imported(conv_bn_relu6_proto())
    assert MemoryFloor(AdapterConfig("memflora", rank=2, seed=3))(model).modified
    onnx.checker.check_model(ir.to_proto(model), full_check=True)
    ops = [n.op_type for n in model.graph]
    assert ops == ["Conv", "Conv", "Conv", "Add", "Mul", "Add", "Greater", "Less", "And", "GreaterOrEqual", "Where",
                   "Where", "GlobalAveragePool", "Flatten"]
    base, project, up = list(model.graph)[:3]
    assert base.inputs[1].name == "conv.weight" and len(base.inputs) == 2  # the bias went into t
    assert project.inputs[1].name == "conv.adapter_P" and list(project.inputs[1].shape) == [2, 3, 1, 1]
    assert up.inputs[1].name == "conv.adapter_U" and list(up.inputs[1].shape) == [4, 2, 3, 3]
    assert list(up.attributes["pads"].value) == [1, 1, 1, 1]  # the base conv's geometry
    assert not up.inputs[1].const_value.numpy().any()  # U = 0
    roles = {name: keys.get_role(v) for name, v in model.graph.initializers.items()}
    assert roles["conv.adapter_U"] == "param" and roles["conv.adapter_P"] == "frozen"
    assert roles["conv.weight"] == "frozen" and "bn.weight" not in roles  # BN folded into s, t
    assert project.outputs[0].metadata_props[keys.ADAPTER_SITE_Q] == "conv"
    meta = json.loads(model.metadata_props[keys.ADAPTER])
    assert meta["adapter_sites"] == 1 and meta["trainable_params"] == 4 * 2 * 9
    assert meta["sites"][0]["scale"] == "bn" and meta["sites"][0]["activation"] == "relu6"


def test_memory_floor_projection_is_normal_with_std_one_over_sqrt_rank_and_seeded() -> None:
    def projection(seed: int, rank: int) -> np.ndarray:
        model = imported(conv_bn_relu6_proto(channels=64))
        MemoryFloor(AdapterConfig("memflora", rank=rank, seed=seed))(model)
        return model.graph.initializers["conv.adapter_P"].const_value.numpy()

    first, again, other = projection(0, 2), projection(0, 2), projection(1, 2)
    np.testing.assert_array_equal(first, again)
    assert not np.array_equal(first, other)
    wide = projection(5, 3)  # 3 x 3 values: the std is loose, the seed rule is exact
    big = np.concatenate([projection(s, 2).ravel() for s in range(40)])
    assert abs(big.std() - 1 / np.sqrt(2)) < 0.06 and abs(big.mean()) < 0.06
    assert wide.shape == (3, 3, 1, 1)


def test_memory_floor_leaves_the_model_alone_without_adapter() -> None:
    model = imported(conv_bn_relu6_proto())
    before = [n.op_type for n in model.graph]
    assert not MemoryFloor(AdapterConfig("none"))(model).modified
    assert [n.op_type for n in model.graph] == before


def test_site_without_batchnorm_takes_unit_scale_and_the_report_says_so() -> None:
    model = imported(conv_bn_relu6_proto(bn=False))
    MemoryFloor(AdapterConfig("memflora", rank=2))(model)
    assert "Mul" not in [n.op_type for n in model.graph]
    meta = json.loads(model.metadata_props[keys.ADAPTER])
    assert meta["sites"][0]["scale"] == "1" and meta["sites_without_batchnorm"] == ["conv"]
    assert "a_s = 1" in meta["note"]


def depthwise_pointwise_proto() -> onnx.ModelProto:
    """MobileNet-style: depthwise 3x3 -> BN -> ReLU6 -> pointwise 1x1 -> BN (no activation) -> pool."""
    rng = np.random.default_rng(8)
    inits = {"dw.weight": rng.standard_normal((4, 1, 3, 3)).astype(np.float32),
             "pw.weight": rng.standard_normal((6, 4, 1, 1)).astype(np.float32),
             "lo": np.array(0.0, np.float32), "hi": np.array(6.0, np.float32)}
    for bn, channels in (("bn1", 4), ("bn2", 6)):
        inits.update({f"{bn}.weight": rng.uniform(0.5, 1.5, channels).astype(np.float32),
                      f"{bn}.bias": rng.normal(0, 0.1, channels).astype(np.float32),
                      f"{bn}.mean": rng.normal(0, 0.1, channels).astype(np.float32),
                      f"{bn}.var": rng.uniform(0.5, 1.5, channels).astype(np.float32)})
    nodes = [helper.make_node("Conv", ["x", "dw.weight"], ["c1"], pads=[1, 1, 1, 1], group=4, name="dw"),
             helper.make_node("BatchNormalization", ["c1"] + [f"bn1.{k}" for k in ("weight", "bias", "mean", "var")],
                              ["b1"], name="bn1"),
             helper.make_node("Clip", ["b1", "lo", "hi"], ["a1"], name="relu6"),
             helper.make_node("Conv", ["a1", "pw.weight"], ["c2"], name="pw"),
             helper.make_node("BatchNormalization", ["c2"] + [f"bn2.{k}" for k in ("weight", "bias", "mean", "var")],
                              ["b2"], name="bn2"),
             helper.make_node("GlobalAveragePool", ["b2"], ["p"], name="pool"),
             helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 6, 5])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 6])], inits)


def inverted_residual_proto(batch: int = 2, channels: int = 8, expand: int = 16, height: int = 7,
                            width: int = 4) -> onnx.ModelProto:
    """MobileNetV2's inverted residual at its last maps (7 x 4: a row is one texel, a plane 7): 1x1 expand -> BN ->
    ReLU6 -> depthwise 3x3 -> BN -> ReLU6 -> 1x1 project -> BN -> pool; two adapter sites (expand, project)."""
    rng = np.random.default_rng(9)
    inits = {"ex.weight": 0.3 * rng.standard_normal((expand, channels, 1, 1)), "dw.weight": 0.3 * rng.standard_normal(
        (expand, 1, 3, 3)), "pr.weight": 0.3 * rng.standard_normal((channels, expand, 1, 1)), "lo": np.array(0.0),
        "hi": np.array(6.0)}
    nodes, last = [], "x"
    for name, groups, out, activation in (("ex", 1, expand, True), ("dw", expand, expand, True), ("pr", 1, channels, False)):
        pads = [1, 1, 1, 1] if groups > 1 else [0, 0, 0, 0]
        nodes.append(helper.make_node("Conv", [last, f"{name}.weight"], [f"{name}.c"], pads=pads, group=groups, name=name))
        inits.update({f"{name}.bn.weight": rng.uniform(0.5, 1.5, out), f"{name}.bn.bias": rng.normal(0, 0.1, out),
                      f"{name}.bn.mean": rng.normal(0, 0.1, out), f"{name}.bn.var": rng.uniform(0.5, 1.5, out)})
        nodes.append(helper.make_node("BatchNormalization", [f"{name}.c"] + [f"{name}.bn.{k}" for k in
                                                                            ("weight", "bias", "mean", "var")],
                                      [f"{name}.b"], name=f"{name}.bn"))
        last = f"{name}.b"
        if activation:
            nodes.append(helper.make_node("Clip", [last, "lo", "hi"], [f"{name}.a"], name=f"{name}.relu6"))
            last = f"{name}.a"
    nodes += [helper.make_node("GlobalAveragePool", [last], ["p"], name="pool"),
              helper.make_node("Flatten", ["p"], ["y"], name="flatten")]
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, channels, height, width])],
                      [helper.make_tensor_value_info("y", TensorProto.FLOAT, [batch, channels])],
                      {k: np.asarray(v, np.float32) for k, v in inits.items()})


def test_depthwise_site_is_frozen_with_batchnorm_folded_and_a_mask() -> None:
    x = np.random.default_rng(0).standard_normal((2, 4, 6, 5)).astype(np.float32)
    (expected,) = run_onnx(imported(depthwise_pointwise_proto()), {"x": x})
    model = imported(depthwise_pointwise_proto())
    assert MemoryFloor(AdapterConfig("memflora", rank=2))(model).modified
    ops = [n.op_type for n in model.graph]
    assert "BatchNormalization" not in ops and "Clip" not in ops
    meta = json.loads(model.metadata_props[keys.ADAPTER])
    assert [s["conv"] for s in meta["sites"]] == ["pw"] and meta["frozen_sites"] == 1
    assert meta["sites"][0]["activation"] == "none"
    dw = next(n for n in model.graph if n.op_type == "Conv" and int(n.attributes["group"].value) == 4)
    assert dw.inputs[1].name == "dw.weight.bn_folded" and dw.inputs[2] is not None  # W * s and t
    (got,) = run_onnx(model, {"x": x})
    np.testing.assert_allclose(got, expected, rtol=RTOL, atol=ATOL)
    every = imported(depthwise_pointwise_proto())
    MemoryFloor(AdapterConfig("memflora", rank=2, sites="all"))(every)  # groups > 1 never gets an adapter
    assert [s["conv"] for s in json.loads(every.metadata_props[keys.ADAPTER])["sites"]] == ["pw"]


# errors -------------------------------------------------------------------------------------------

def test_errors_no_site_rank_unknown_adapter_and_bn_train(tmp_path) -> None:
    with pytest.raises(FblcError, match="--adapter memflora found no eligible site.*use --adapter none"):
        MemoryFloor(AdapterConfig("memflora", rank=2))(imported(mlp_proto()))
    with pytest.raises(FblcError, match=r"--rank 5 is larger than the channels of conv 'conv' \(3 in, 4 out\).*--rank 3"):
        MemoryFloor(AdapterConfig("memflora", rank=5))(imported(conv_bn_relu6_proto()))
    with pytest.raises(FblcError, match="unknown adapter 'dora'.*none, lora, memflora, memflora-sg"):
        MemoryFloor(AdapterConfig("dora", rank=2))(imported(conv_bn_relu6_proto()))
    with pytest.raises(FblcError, match="--rank 0 is not a positive rank"):
        MemoryFloor(AdapterConfig("memflora", rank=0))(imported(conv_bn_relu6_proto()))
    with pytest.raises(FblcError, match="needs BatchNormalization in eval mode.*drop --bn-train"):
        MemoryFloor(AdapterConfig("memflora", rank=2), bn_train=True)(imported(conv_bn_relu6_proto()))
    from fblc.cli import main
    path = str(tmp_path / "m.onnx")
    onnx.save(conv_bn_relu6_proto(), path)
    assert main(["compile", path, "--adapter", "memflora", "--rank", "9", "-o", str(tmp_path / "b")]) == 2
    with pytest.raises(SystemExit):
        main(["compile", path, "--adapter", "dora", "-o", str(tmp_path / "b")])


# numeric: T-ResNet against a PyTorch MemFLoRA written from the paper ------------------------------

def _same(kernel: int) -> tuple[int, int, int, int]:
    """F.pad arguments for padding='same' along time (dim 2), as torch splits an even kernel."""
    total = kernel - 1
    return (0, 0, total // 2, total - total // 2)


class TorchMemFLoRATResNet(torch.nn.Module):
    """MemFLoRA on T-ResNet: every conv of every block gets y = act(BN(W x) + a_s * U(P x))."""

    def __init__(self, base: torch.nn.Module, projections: dict[str, np.ndarray], train_projection: bool) -> None:
        super().__init__()
        self.base = base
        for p in base.parameters():
            p.requires_grad_(False)
        self.P = torch.nn.ParameterDict()
        self.U = torch.nn.ParameterDict()
        for name, module in base.named_modules():
            if isinstance(module, torch.nn.Conv2d):
                key = name.replace(".", "__")
                self.P[key] = torch.nn.Parameter(torch.from_numpy(projections[name].copy()),
                                                 requires_grad=train_projection)
                self.U[key] = torch.nn.Parameter(torch.zeros(module.out_channels, projections[name].shape[0],
                                                             *module.kernel_size))

    def site(self, name: str, conv: torch.nn.Conv2d, bn: torch.nn.BatchNorm2d, x: torch.Tensor) -> torch.Tensor:
        key = name.replace(".", "__")
        pads = _same(conv.kernel_size[0])
        base = F.conv2d(F.pad(x, pads), conv.weight, conv.bias)
        q = F.conv2d(x, self.P[key])  # the rank-r bottleneck, P frozen unless SG
        delta = F.conv2d(F.pad(q, pads), self.U[key])
        a_s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
        return F.batch_norm(base, bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.0, bn.eps) \
            + a_s.view(1, -1, 1, 1) * delta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for index, block in enumerate(self.base.blocks):
            prefix = f"blocks.{index}"
            h = torch.relu(self.site(f"{prefix}.conv1", block.conv1, block.bn1, x))
            h = torch.relu(self.site(f"{prefix}.conv2", block.conv2, block.bn2, h))
            h = self.site(f"{prefix}.conv3", block.conv3, block.bn3, h)
            shortcut = x if block.shortcut is None else self.site(f"{prefix}.shortcut.conv", block.shortcut.conv,
                                                                   block.shortcut.bn, x)
            x = torch.relu(shortcut + h)
        return self.base.fc(x.mean(dim=(2, 3)))


@pytest.fixture(scope="module")
def tresnet(tmp_path_factory) -> models.ExportedModel:
    return models.tresnet(str(tmp_path_factory.mktemp("mf_tresnet")))


def _step(model: models.ExportedModel, kind: str, folder, seed: int = 0) -> tuple[ReferenceStep, ir.Model]:
    step = build_training_graph(load_model(model.path), TrainingOptions(
        input_shapes=model.input_shapes, optimizer=ADAM, adapter=AdapterConfig(kind, rank=2, seed=seed)))
    path = os.path.join(str(folder), f"{model.name}_{kind}.onnx")
    save_model_atomically(step, path)
    return ReferenceStep(path), step


def _projections(step: ir.Model) -> dict[str, np.ndarray]:
    meta = json.loads(step.metadata_props[keys.ADAPTER])
    return {s["weight"][: -len(".weight")]: step.graph.initializers[s["P"]].const_value.numpy() for s in meta["sites"]}


def _torch_steps(model: models.ExportedModel, step: ir.Model, train_projection: bool, count: int):
    module = TorchMemFLoRATResNet(copy.deepcopy(model.module).eval(), _projections(step), train_projection)
    adapters = [module.U[k] for k in module.U]
    groups = [{"params": adapters, "lr": 1e-3, "weight_decay": 5e-4}]
    optimizer = torch.optim.Adam(groups)
    projection_optimizer = torch.optim.Adam([module.P[k] for k in module.P], lr=1e-3) if train_projection else None
    x, target = torch.from_numpy(model.inputs["x"]), torch.from_numpy(model.labels)
    history = []
    for _ in range(count):
        optimizer.zero_grad()
        if projection_optimizer:
            projection_optimizer.zero_grad()
        loss = F.cross_entropy(module(x), target)
        loss.backward()
        grads = {k: module.U[k].grad.numpy().copy() for k in module.U}
        p_grads = {k: module.P[k].grad.numpy().copy() for k in module.P} if train_projection else {}
        optimizer.step()
        if projection_optimizer:
            projection_optimizer.step()
        history.append((float(loss.detach()), grads, p_grads, {k: module.U[k].detach().numpy().copy() for k in module.U},
                        {k: module.P[k].detach().numpy().copy() for k in module.P}))
    return history


def _fblc_name(key: str, factor: str) -> str:
    return f"{key.replace('__', '.')}.adapter_{factor}"


def test_adapter_forward_equals_the_base_model_at_init_tresnet(tresnet) -> None:
    base = run_passes(load_model(tresnet.path), import_passes(TrainingOptions()))
    adapted = run_passes(load_model(tresnet.path), import_passes(TrainingOptions()) + [
        MemoryFloor(AdapterConfig("memflora", rank=2, seed=1))])
    (expected,), (got,) = run_onnx(base, tresnet.inputs), run_onnx(adapted, tresnet.inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_memflora_training_steps_equal_pytorch_tresnet(tresnet, tmp_path) -> None:
    reference, step = _step(tresnet, "memflora", tmp_path)
    expected = _torch_steps(tresnet, step, train_projection=False, count=2)
    assert sorted(reference.parameters()) == sorted(_fblc_name(k, "U") for k in expected[0][1])
    feeds = {**tresnet.inputs, "labels": tresnet.labels}
    for loss, grads, _, updated, _ in expected:
        got = reference.step(feeds)
        assert got == pytest.approx(loss, rel=RTOL)
        for key in grads:
            name = _fblc_name(key, "U")
            np.testing.assert_allclose(reference.last[f"{name}.grad"], grads[key], rtol=RTOL, atol=ATOL, err_msg=name)
            np.testing.assert_allclose(reference.last[f"{name}.new"], updated[key], rtol=RTOL, atol=ATOL, err_msg=name)


def test_memflora_backward_reads_only_q_masks_and_the_loss(tresnet) -> None:
    step = build_training_graph(load_model(tresnet.path), TrainingOptions(
        input_shapes=tresnet.input_shapes, optimizer=ADAM, adapter=AdapterConfig("memflora", rank=2)))
    saved = [v for n in step.graph for v in n.outputs if keys.get_role(v) == "saved"]
    kinds = set()
    for value in saved:
        producer = value.producer()
        if value.dtype == ir.DataType.BOOL:
            kinds.add("mask")
        elif keys.ADAPTER_SITE_Q in value.metadata_props:
            kinds.add("q")
            assert list(value.shape)[1] == 2
        else:
            assert producer.metadata_props.get(keys.STAGE) == "loss", value.name
            kinds.add("loss")
    assert kinds == {"mask", "q", "loss"}
    assert sum(1 for v in saved if keys.ADAPTER_SITE_Q in v.metadata_props) == 11  # every conv of T-ResNet


def test_memflora_sg_projection_gradient_equals_the_full_width_gradient(tresnet, tmp_path) -> None:
    reference, step = _step(tresnet, "memflora-sg", tmp_path)
    expected = _torch_steps(tresnet, step, train_projection=True, count=2)
    feeds = {**tresnet.inputs, "labels": tresnet.labels}
    for loss, grads, p_grads, updated, projections in expected:
        assert reference.step(feeds) == pytest.approx(loss, rel=RTOL)
        for key in grads:
            for factor, want, new in (("U", grads[key], updated[key]), ("P", p_grads[key], projections[key])):
                name = _fblc_name(key, factor)
                np.testing.assert_allclose(reference.last[f"{name}.grad"], want, rtol=RTOL, atol=ATOL, err_msg=name)
                np.testing.assert_allclose(reference.last[f"{name}.new"], new, rtol=RTOL, atol=ATOL, err_msg=name)
    saved = [v for n in step.graph for v in n.outputs if keys.get_role(v) == "saved"]
    assert all(v.dtype == ir.DataType.BOOL or keys.ADAPTER_SITE_Q in v.metadata_props
               or v.producer().metadata_props.get(keys.STAGE) == "loss" for v in saved)


def test_lora_trains_both_factors_and_saves_the_projection_input(tresnet, tmp_path) -> None:
    reference, step = _step(tresnet, "lora", tmp_path)
    trainable = sorted(reference.parameters())
    assert len(trainable) == 22 and all(n.endswith(("adapter_P", "adapter_U")) for n in trainable)
    saved_names = {v.name for n in step.graph for v in n.outputs if keys.get_role(v) == "saved"}
    saved_names |= {v.name for v in step.graph.inputs if keys.get_role(v) == "input"}
    meta = json.loads(step.metadata_props[keys.ADAPTER])
    for site in meta["sites"]:  # dP reads x, the full-width input of the down-projection
        assert site["extra"]["x"] in saved_names, site["conv"]
    assert reference.step({**tresnet.inputs, "labels": tresnet.labels}) > 0


# numeric: MobileNetV2 (transformers, BN kept) ------------------------------------------------------

def _mobilenet_reference(model: models.ExportedModel, step: ir.Model) -> torch.nn.Module:
    """HF MobileNetV2 with MemFLoRA at every pointwise conv layer, from the paper's eq. 8."""
    module = copy.deepcopy(model.module).eval()
    for p in module.parameters():
        p.requires_grad_(False)
    projections = _projections(step)
    module.adapter_U = torch.nn.ParameterDict()
    for name, layer in module.named_modules():
        conv = getattr(layer, "convolution", None)
        if not isinstance(conv, torch.nn.Conv2d) or conv.groups != 1 or conv.kernel_size != (1, 1):
            continue
        key = f"{name}.convolution"
        u = torch.nn.Parameter(torch.zeros(conv.out_channels, 2, 1, 1))
        module.adapter_U[key.replace(".", "__")] = u
        p = torch.from_numpy(projections[key].copy())

        def forward(self, x, conv=conv, u=u, p=p):
            bn = self.normalization
            a_s = bn.weight / torch.sqrt(bn.running_var + bn.eps)
            z = bn(conv(x)) + a_s.view(1, -1, 1, 1) * F.conv2d(F.conv2d(x, p), u)
            return self.activation(z) if self.activation is not None else z

        layer.forward = types.MethodType(forward, layer)
    return module


def test_memflora_on_mobilenet_v2_forward_and_one_step_equal_pytorch(tmp_path_factory, tmp_path) -> None:
    model = models.mobilenet_v2(str(tmp_path_factory.mktemp("mf_mobilenet")))
    base = run_passes(load_model(model.path), import_passes(TrainingOptions()))
    adapted = run_passes(load_model(model.path), import_passes(TrainingOptions()) + [
        MemoryFloor(AdapterConfig("memflora", rank=2, seed=4))])
    (expected,), (got,) = run_onnx(base, model.inputs), run_onnx(adapted, model.inputs)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    reference, step = _step(model, "memflora", tmp_path, seed=4)
    module = _mobilenet_reference(model, step)
    assert len(module.adapter_U) == 34 and len(reference.parameters()) == 34
    optimizer = torch.optim.Adam(list(module.adapter_U.values()), lr=1e-3, weight_decay=5e-4)
    feeds = {**model.inputs, "labels": model.labels}
    for _ in range(2):
        optimizer.zero_grad()
        loss = model.loss_of(module)
        loss.backward()
        assert reference.step(feeds) == pytest.approx(float(loss.detach()), rel=RTOL)
        for key, u in module.adapter_U.items():
            name = _fblc_name(key, "U")
            np.testing.assert_allclose(reference.last[f"{name}.grad"], u.grad.numpy(), rtol=1e-3, atol=1e-5,
                                       err_msg=name)
        optimizer.step()
        for key, u in module.adapter_U.items():
            name = _fblc_name(key, "U")
            np.testing.assert_allclose(reference.last[f"{name}.new"], u.detach().numpy(), rtol=RTOL, atol=ATOL,
                                       err_msg=name)
