"""The random graph generator's builder state: the graph being grown, its tensors, and the table of op
builders (GROWERS) that fblc/tools/random_graphs.py and fblc/tools/random_blocks.py fill."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

Shape = tuple[int, ...]


@dataclass(frozen=True)
class GraphInput:
    name: str
    shape: Shape
    #: "float" (standard normal), "ids" (int64 in [0, high)) or "mask" (int64 0/1, position 0 always 1)
    kind: str
    high: int = 0


@dataclass
class Maker:
    rng: np.random.Generator
    nodes: list[onnx.NodeProto] = field(default_factory=list)
    inits: dict[str, np.ndarray] = field(default_factory=dict)
    ops: list[str] = field(default_factory=list)
    inputs: list[GraphInput] = field(default_factory=list)
    #: a token graph's padding mask as additive attention biases, by the rank of the scores they broadcast to
    mask_bias: dict[int, str] = field(default_factory=dict)
    #: a token graph's (batch, sequence length): the scores a mask applies to
    tokens: Shape | None = None

    def fresh(self, hint: str) -> str:
        return f"{hint}_{len(self.nodes) + len(self.inits)}"

    def param(self, shape: Shape, scale: float = 1.0, positive: bool = False) -> str:
        name = self.fresh("p")
        values = self.rng.standard_normal(shape) * scale
        self.inits[name] = (np.abs(values) + 0.5 if positive else values).astype(np.float32)
        return name

    def constant(self, values: np.ndarray) -> str:
        """A constant: an initializer when integer or bool, a Constant node when float (an initializer of
        float type would be a trainable parameter, as an exporter's weights are)."""
        name = self.fresh("c")
        if values.dtype != np.float32:
            self.inits[name] = values
        else:
            self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                               value=numpy_helper.from_array(values, name)))
        return name

    def ints(self, values: Sequence[int] | np.ndarray) -> str:
        return self.constant(np.asarray(values, np.int64))

    def scalar(self, value: float) -> str:
        return self.constant(np.array(value, np.float32))

    def op(self, op_type: str, inputs: list[str], **attrs: object) -> str:
        return self.ops_multi(op_type, inputs, 1, **attrs)[0]

    def ops_multi(self, op_type: str, inputs: list[str], outputs: int, **attrs: object) -> list[str]:
        first = self.fresh(op_type.lower())
        names = [first] + [f"{first}_{i}" for i in range(1, outputs)]
        self.nodes.append(helper.make_node(op_type, inputs, names, name=first, **attrs))
        self.ops.append(op_type)
        return names


@dataclass
class Tensor:
    """A tensor of the graph being grown: its name and static shape."""
    name: str
    shape: Shape


Grower = Callable[[Maker, Tensor, list[Tensor]], "Tensor | None"]
#: builders keyed by name: each takes the current tensor (and the live ones, for joins) and
#: returns the grown tensor, or None when it does not apply to that shape
GROWERS: dict[str, Grower] = {}


def grower(name: str) -> Callable[[Grower], Grower]:
    def register(function: Grower) -> Grower:
        GROWERS[name] = function
        return function
    return register
