"""ES members in a loop: one member forward that the kernel plan repeats 2P times (issue 40, part 3).

`fblc compile --trainer es` builds the members as one forward indexed by the member counter `es.member`
(a float32 scalar, 0 .. 2P - 1), not as 2P copies (es_gradients with EsConfig.loop):

    row      i = m            for m < P (the +eps members),  m - P  otherwise (the -eps members)
    theta_m  = theta + s sigma noise[i],   s = +1 for m < P, -1 otherwise
    rewards  es.rewards.next = Where(arange(2P) == m, reward(theta_m), es.rewards)
    counter  es.member.next  = m + 1, or 0 after the last member

`es.member` and `es.rewards` are graph inputs (initializers, 0) that the loop carries (keys.LOOP_CARRIED names
the output that is their next value); after the loop `rewards` = `es.rewards`, which the z-scores and the
direction read as the unrolled step's rewards. The kernel plan launches the member's kernels 2P times and
swaps each carried pair's textures after every repetition (plan.json `loops`, both runtimes), so the member
counter is back at 0 when the next step begins and launches, plan size and compile time do not grow with P.
The ONNX step onnxruntime checks stays the unrolled one (`fblc train-graph`, fblc.tools.verify.reference_graph):
its numbers are the loop's, member by member, in the same order.

`loop_phases` splits a graph with carried values into what runs before the loop, in its body and after it.
"""

from __future__ import annotations

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.graph import Emitter, static_shape

#: the member counter the loop carries (0 .. 2P - 1) and the rewards it fills, one member per repetition
MEMBER = "es.member"
CARRIED_REWARDS = "es.rewards"
NEXT = ".next"
BEFORE, BODY, AFTER = "before", "body", "after"


def carried_input(graph: ir.Graph, name: str, initial: np.ndarray, before: ir.Value) -> ir.Value:
    """A graph input `name` holding `initial` (an initializer), inserted before `before`, that a loop carries."""
    value = ir.Value(name=name, shape=ir.Shape(list(initial.shape)), type=ir.TensorType(ir.DataType.FLOAT),
                     const_value=ir.tensor(initial.astype(np.float32), name=name))
    value.metadata_props[keys.LOOP_CARRIED] = name + NEXT
    keys.set_role(value, keys.Role.CARRIED)
    graph.inputs.insert(graph.inputs.index(before), value)
    graph.register_initializer(value)
    return value


def member_perturbation(e: Emitter, member: ir.Value, noise: ir.Value, sigma: float
                        ) -> tuple[ir.Value, ir.Value, ir.Value]:
    """(member m's noise row [D], its signed sigma, the counter's next value): row m of `noise` [P, D] for m < P,
    row m - P after; the next value m + 1, or 0 after member 2P - 1, is computed from the row and the half so
    that fuse makes one kernel of the three scalars."""
    pairs, width = static_shape(noise)
    first_half = e.op("Less", member, e.scalar(pairs, member))
    row = e.op("Where", first_half, member, e.op("Sub", member, e.scalar(pairs, member)))
    index = e.op("Cast", e.reshape(row, [1, 1]), to=ir.DataType.INT64)
    rows = e.op("Expand", index, e.ints([1, width]))  # GatherElements' indices: the row in every column
    eps = e.reshape(e.op("GatherElements", noise, rows, axis=0), [width])
    scale = e.op("Where", first_half, e.scalar(sigma, member), e.scalar(-sigma, member))
    after = e.op("Add", row, e.scalar(1.0, member))
    minus = e.op("Where", e.op("Less", after, e.scalar(pairs, member)), e.op("Add", after, e.scalar(pairs, member)),
                 e.scalar(0.0, member))
    following = e.op("Where", first_half, after, minus, name=member.name + NEXT)
    keys.set_role(following, keys.Role.CARRIED)
    return eps, scale, following


def next_rewards(e: Emitter, member: ir.Value, reward: ir.Value, rewards: ir.Value) -> ir.Value:
    """`rewards` with element m replaced by `reward` [1]."""
    count = static_shape(rewards)[0]
    slots = e.const(np.arange(count, dtype=np.float32))
    following = e.op("Where", e.op("Equal", slots, member), reward, rewards, name=rewards.name + NEXT)
    keys.set_role(following, keys.Role.CARRIED)
    return following


def carried_pairs(graph: ir.Graph) -> list[tuple[ir.Value, ir.Value]]:
    """(carried input, the output that is its next value) of every value a loop carries, in input order."""
    outputs = {v.name: v for v in graph.outputs}
    pairs = []
    for value in graph.inputs:
        following = value.metadata_props.get(keys.LOOP_CARRIED)
        if following is not None:
            if following not in outputs:
                raise AssertionError(f"loop-carried '{value.name}' names '{following}', which is no graph output")
            pairs.append((value, outputs[following]))
    return pairs


def loop_phases(graph: ir.Graph) -> dict[int, str]:
    """id(node) -> BEFORE, BODY or AFTER the loop; {} when nothing is carried. The body: the nodes that depend on a
    carried input and make a carried output (its next value), or that nothing after reads; before: what the body reads of the others; after:
    the rest. Nothing after the loop may read a value of the body (it would see only the last repetition's)."""
    pairs = carried_pairs(graph)
    if not pairs:
        return {}
    nodes = list(graph)
    tainted = {id(v) for v, _ in pairs}
    descends = set()
    for node in nodes:
        if any(v is not None and id(v) in tainted for v in node.inputs):
            descends.add(id(node))
            tainted.update(id(v) for v in node.outputs)
    needed = {id(out) for _, out in pairs}
    carried_out = set(needed)
    live = {id(v) for v in graph.outputs if id(v) not in carried_out}  # what the step's other outputs read
    body, before = set(), set()
    for node in reversed(nodes):
        # a member's node that nothing after reads (nor the step's outputs) is repeated with the member too
        unread = id(node) in descends and not any(id(v) in live for v in node.outputs)
        if unread or any(id(v) in needed for v in node.outputs):
            (body if id(node) in descends else before).add(id(node))
            needed.update(id(v) for v in node.inputs if v is not None)
        if any(id(v) in live for v in node.outputs):
            live.update(id(v) for v in node.inputs if v is not None)
    phases = {id(n): BODY if id(n) in body else BEFORE if id(n) in before else AFTER for n in nodes}
    for node in nodes:
        if phases[id(node)] != BODY:
            for value in node.inputs:
                producer = value.producer() if value is not None else None
                if producer is not None and phases[id(producer)] == BODY:
                    raise AssertionError(f"'{node.name}' runs {phases[id(node)]} the loop but reads '{value.name}' "
                                         "of its body, which holds only the last repetition's value")
    return phases
