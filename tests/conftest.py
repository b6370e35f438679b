"""Shared fixtures: small hand-built ONNX models for pass and CLI tests.

Kernel builds: the suite's time is mostly PoCL compiling kernels from a cold cache, and an unoptimised build
costs less CPU time (a MobileNetV2 step 2.4x less, test_kernels_activations 1.5x less) for the same OpenCL C,
checked against the same references. So every test builds with -cl-opt-disable (pyopencl's
PYOPENCL_BUILD_OPTIONS, which the native runner's tests forward: fblc.runtime.native.pyopencl_build_options),
unless PYOPENCL_BUILD_OPTIONS is set already, except where a test asks for `optimised_kernel_builds`: the
R-Tile fp32 steps of test_device_models' MLP, T-ResNet and Llama decoder and test_runtime's several
steps (state updated in place), whose kernels must run right as a user's optimised build runs them (an
optimiser exploits `restrict` and undefined behaviour; -O0 does not).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

#: what every kernel build of the suite adds (see the module docstring)
TEST_BUILD_OPTIONS = "-cl-opt-disable"
os.environ.setdefault("PYOPENCL_BUILD_OPTIONS", TEST_BUILD_OPTIONS)


@pytest.fixture
def optimised_kernel_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels built as a user's run builds them: optimised (pyopencl reads PYOPENCL_BUILD_OPTIONS at each build)."""
    if os.environ.get("PYOPENCL_BUILD_OPTIONS") == TEST_BUILD_OPTIONS:
        monkeypatch.delenv("PYOPENCL_BUILD_OPTIONS")


def make_model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
               initializers: dict[str, np.ndarray], opset: int = 18) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "test", inputs, outputs,
                              initializer=[numpy_helper.from_array(v, k) for k, v in initializers.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    onnx.checker.check_model(model)
    return model


def mlp_proto(batch: int | str = 4, seed: int = 0) -> onnx.ModelProto:
    """x[batch, 6] -> Gemm(8) -> Relu -> Identity -> MatMul(3) + b: logits [batch, 3]."""
    rng = np.random.default_rng(seed)
    nodes = [
        helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], transB=1, name="fc1"),
        helper.make_node("Relu", ["h"], ["a"], name="relu"),
        helper.make_node("Identity", ["a"], ["a2"], name="noop"),
        helper.make_node("MatMul", ["a2", "w2"], ["m"], name="fc2"),
        helper.make_node("Add", ["m", "b2"], ["logits"], name="bias2"),
    ]
    inits = {"w1": rng.standard_normal((8, 6)).astype(np.float32), "b1": rng.standard_normal(8).astype(np.float32),
             "w2": rng.standard_normal((8, 3)).astype(np.float32), "b2": rng.standard_normal(3).astype(np.float32)}
    return make_model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 6])],
                      [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, 3])], inits)


@pytest.fixture
def mlp_path(tmp_path) -> str:
    path = str(tmp_path / "mlp.onnx")
    onnx.save(mlp_proto(), path)
    return path


@pytest.fixture(scope="module")
def merged_folder(tmp_path_factory) -> Callable[[str], str]:
    """A new folder per name, for the merged steps of tests/support/merged_steps.MergedCases.check."""
    return lambda name: str(tmp_path_factory.mktemp(name))


@pytest.fixture
def small_profile_plan() -> Iterator[None]:
    """`fblc profile` measures with tests/support/profile_plan's small plan (same probes, ~20x less work)."""
    from tests.support.profile_plan import small_profile_plan as small

    with small():
        yield


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`--dist loadgroup` on an xdist worker: each item of an `xdist_group` gets its '@group' nodeid suffix, by
    which the controller sends a group's tests to one worker (a merged step or a shared bundle built once).
    pytest-xdist 3.8 writes the suffix to `item._nodeid`, which pytest 9.2 no longer reads (its nodeid is
    `str(item._id)`): every group was silently split over both workers, each building the group's step."""
    if not getattr(config.option, "loadgroup", False):
        return
    for item in items:
        names = sorted({str(mark.args[0] if mark.args else mark.kwargs.get("name", "default"))
                        for mark in item.iter_markers("xdist_group")})
        suffix = "@" + "_".join(names)
        if not names or item.nodeid.endswith(suffix):
            continue
        if hasattr(item, "_id"):
            from _pytest.nodeid import NodeId  # pytest >= 9.2: the nodeid's structured form

            item._id = NodeId.parse(item.nodeid + suffix)
        if not item.nodeid.endswith(suffix):
            raise pytest.UsageError(f"{item.nodeid}: cannot give it its xdist group suffix {suffix!r} (pytest "
                                    f"{pytest.__version__}): its group would be split over the workers")
