"""The reference executor: onnxruntime runs a training-step ONNX step after step.

Every later stage (OpenCL kernels, the native runner) is checked against this. The state
(parameters, optimizer state) starts from the step's input defaults (initializers, or the
`.initial` values of `fblc train-graph`'s optional state inputs); after each step the
`.new` outputs become the next step's inputs, as the step interface defines.
"""

from __future__ import annotations

from typing import Mapping

import numpy as np
import onnx
import onnx_ir as ir
import onnxruntime as ort

from fblc.compiler import keys
from fblc.bundle_format import checked_rewards
from fblc.compiler.es import MEMBER_PREFIX, NOISE, REWARDS_OUTPUT, RewardFunction
from fblc.compiler.optional_state import input_defaults
from fblc.compiler.philox import es_noise
from fblc.errors import FblcError
from fblc.compiler.keys import Role
from fblc.compiler.values import static_shape


def onnxruntime_session(model: onnx.ModelProto | str) -> ort.InferenceSession:
    """An onnxruntime CPU session of a model (a proto or a file), quiet about what a step does by design."""
    options = ort.SessionOptions()
    options.log_severity_level = 3  # a step's state inputs are also initializers, by design
    # quantized weights (DequantizeLinear, --weights int4/int8) as written: onnxruntime's default fuses a blocked
    # int4 DequantizeLinear and its MatMul into MatMulNBits at accuracy level 4, which rounds the activations to
    # int8 (0.3 % off a small model's loss), and the device dequantizes the weights alone
    options.add_session_config_entry("session.disable_quant_qdq", "1")
    source = model.SerializeToString() if isinstance(model, onnx.ModelProto) else model
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def run_model(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Every output of `model` by name, fed those of `feeds` it takes (initializers keep their values)."""
    session = onnxruntime_session(model)
    taken = {i.name for i in session.get_inputs()}
    return dict(zip([o.name for o in session.get_outputs()],
                    session.run(None, {k: v for k, v in feeds.items() if k in taken})))


class ReferenceStep:
    """Train with a step graph on onnxruntime's CPU provider."""

    def __init__(self, step_path: str) -> None:
        model = onnx.load(step_path)
        initial = input_defaults(model)
        self.session = onnxruntime_session(step_path)
        outputs = [o.name for o in self.session.get_outputs()]
        self.output_names = outputs
        self.state: dict[str, np.ndarray] = {
            name[: -len(".new")]: initial[name[: -len(".new")]] for name in outputs if name.endswith(".new")}
        self.data_inputs = [i.name for i in self.session.get_inputs()
                            if i.name not in self.state and i.name not in initial]
        self.last: dict[str, np.ndarray] = {}
        self.steps = 0
        metadata = {p.key: p.value for p in model.metadata_props}
        #: an ES step's noise when the caller feeds none: the device's Philox noise of the same step
        self.noise_seed = int(keys.json_of(metadata, keys.ES)["seed"]) if keys.ES in metadata else None
        self.noise_shape = next((list(i.shape) for i in self.session.get_inputs() if i.name == NOISE), None)

    def step(self, feeds: Mapping[str, np.ndarray], reward: RewardFunction | None = None) -> float:
        """Run one step on `feeds` (model inputs and labels); returns the loss. An ES step's `noise`,
        when not fed, is `es_noise(seed, step index, shape)`: what a bundle of the step makes on the device.
        An ES step with `--reward external` takes `reward(member outputs) -> 2P rewards`."""
        if NOISE in self.data_inputs and NOISE not in feeds and self.noise_seed is not None:
            feeds = {**feeds, NOISE: es_noise(self.noise_seed, self.steps, self.noise_shape)}
        if REWARDS_OUTPUT in self.data_inputs and REWARDS_OUTPUT not in feeds:
            if reward is None:
                raise FblcError("this ES step takes its rewards from the application (--reward external)",
                                "pass step(feeds, reward=fn), fn mapping the members' outputs to 2P rewards")
            members = [name for name in self.output_names if name.startswith(MEMBER_PREFIX)]
            probe = self._run({**feeds, REWARDS_OUTPUT: np.zeros(len(members), np.float32)}, members)
            feeds = {**feeds, REWARDS_OUTPUT: checked_rewards(reward([probe[name] for name in members]), len(members))}
        self.last = self._run(feeds)
        self.steps += 1
        for name in self.state:
            self.state[name] = self.last[f"{name}.new"]
        return float(self.last["loss"])

    def _run(self, feeds: Mapping[str, np.ndarray], outputs: list[str] | None = None) -> dict[str, np.ndarray]:
        """`outputs` (default all) of the step on `feeds` and the current state; the state stays."""
        missing = [name for name in self.data_inputs if name not in feeds]
        if missing:
            raise FblcError(f"the step needs inputs {missing}", f"provide arrays for: {', '.join(self.data_inputs)}")
        names = outputs or self.output_names
        return dict(zip(names, self.session.run(names, {**{k: feeds[k] for k in self.data_inputs}, **self.state})))

    def parameters(self) -> dict[str, np.ndarray]:
        """Current values of the trainable parameters (not the optimizer state)."""
        return {name: value for name, value in self.state.items() if f"{name}.grad" in self.output_names}


def _index_bound(value: ir.Value, graph: ir.Graph) -> int:
    """A safe exclusive upper bound for integer feeds: classes for labels, table rows for Gather indices."""
    bounds = []
    for use in value.uses():
        node = use.node
        if node.op_type == "Gather" and use.idx == 1:
            bounds.append(static_shape(node.inputs[0])[int(node.attributes["axis"].value) if "axis" in node.attributes else 0])
        elif node.op_type == "GatherND" and use.idx == 1:  # every tuple entry indexes one of these axes
            batch = int(node.attributes["batch_dims"].value) if "batch_dims" in node.attributes else 0
            bounds.append(min(static_shape(node.inputs[0])[batch:batch + static_shape(value)[-1]], default=0))
        elif node.op_type in ("Equal", "Where", "Unsqueeze", "GatherElements"):
            for out in node.outputs:
                bounds.append(_index_bound(out, graph))
    if keys.get_role(value) == Role.LABEL.value and graph.outputs:
        for node in graph:
            if node.op_type == "LogSoftmax":
                bounds.append(static_shape(node.inputs[0])[-1])
    return min([b for b in bounds if b > 0], default=2)


def random_feeds(step: ir.Model, seed: int = 0) -> dict[str, np.ndarray]:
    """A batch that fits the step's inputs: normal floats, in-range integers."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in step.graph.inputs:
        if keys.get_role(value) not in (Role.INPUT.value, Role.LABEL.value):
            continue
        shape = static_shape(value)
        if value.dtype in (ir.DataType.FLOAT, ir.DataType.FLOAT16, ir.DataType.DOUBLE):
            feeds[value.name] = rng.standard_normal(shape).astype(ir.DataType(value.dtype).numpy())
        else:
            feeds[value.name] = rng.integers(0, _index_bound(value, step.graph), shape).astype(
                ir.DataType(value.dtype).numpy())
    return feeds
