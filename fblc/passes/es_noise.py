"""es_noise: the ES step's `noise` is made on the device, row by row where it is read.

Rewrite: every reader of the graph input `noise` [P, D] (role `noise`, made by es_gradients)
reads Philox noise made on the device instead (fblc's device-only ops, seed from `--seed`,
kernels in fblc/codegen/kernels/noise.py):
- a member's row, Slice(noise, [i], [i + 1], axes [0]), becomes PhiloxNormal(es.iteration) of row i;
- the row of the member loop's counter, GatherElements(noise, i expanded over [1, D]) (fblc.compiler.es_loop), becomes
  PhiloxNormal(es.iteration, [i]), which reads the row from its second input;
- the direction, MatMul(weights [1, P], noise), becomes PhiloxWeightedSum(weights, es.iteration),
  which makes each row again inside its kernel;
so no [P, D] tensor exists and a row lives only while its member is perturbed. `es.iteration`
is a new float32 scalar state (role `opt_state`, 0 at the start) with the output
`es.iteration.new` = es.iteration + 1: iteration i of a run perturbs with
`fblc.compiler.philox.es_noise(seed, i, [P, D])`, which `fblc.compiler.reference.ReferenceStep`
feeds the ONNX step at its step i.

Preconditions: the training passes ran (es_gradients's `noise` input, the step's outputs); the
noise is read only by those two forms (es_gradients writes no other). In place; `modified` is
false for a step without `noise` (backprop).
"""

from __future__ import annotations


import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.es import ITERATION
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.compiler.values import ints_input
from fblc.passes.contracts import ContractPass


def _row_index(indices: ir.Value) -> ir.Value:
    """The row a member loop's GatherElements reads (fblc.compiler.es_loop.member_perturbation): its indices are
    the row expanded over the columns, an int64 Cast of the float row where the counter makes it, which
    PhiloxNormal reads as it is (a float row index is exact); PhiloxNormal reads element 0 of what it is given."""
    spread = indices.producer()
    row = spread.inputs[0] if spread is not None and spread.op_type == "Expand" else indices
    cast = row.producer() if row is not None else None
    if cast is not None and cast.op_type == "Cast" and cast.inputs[0] is not None \
            and cast.inputs[0].dtype == ir.DataType.FLOAT:
        return cast.inputs[0]
    return row


class EsNoise(ContractPass):
    """Replace each reader of the `noise` input by on-device Philox noise and count the iterations (in place)."""

    name = "es_noise"
    requires_facts = ("updates",)
    ensures_facts = ("updates", "static shapes")

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        noise = next((v for v in graph.inputs if keys.get_role(v) == Role.NOISE.value), None)
        if noise is None:
            return ir.passes.PassResult(model, False)
        seed = int(keys.json_of(model.metadata_props, keys.ES)["seed"])
        width = static_shape(noise)[1]
        counter = ir.Value(name=ITERATION, shape=ir.Shape([]), type=ir.TensorType(ir.DataType.FLOAT),
                           const_value=ir.tensor(np.array(0.0, np.float32), name=ITERATION))
        keys.set_role(counter, Role.OPT_STATE)
        graph.inputs.append(counter)
        graph.register_initializer(counter)
        e = Emitter(graph, stage="es")
        for use in list(noise.uses()):
            reader = use.node
            e.anchor = reader
            if reader.op_type == "Slice":
                row = int(ints_input(reader, 1, "starts")[0])
                made = e.op("PhiloxNormal", counter, seed=seed, row=row, shape=[1, width], name=f"es/noise_row_{row}")
            elif reader.op_type == "GatherElements" and use.idx == 0:  # the row of a member loop's counter (es_loop)
                made = e.op("PhiloxNormal", counter, _row_index(reader.inputs[1]), seed=seed, shape=[1, width],
                            name="es/noise_row")
            elif reader.op_type == "MatMul" and use.idx == 1:
                made = e.op("PhiloxWeightedSum", reader.inputs[0], counter, seed=seed, shape=[1, width],
                            name="es/direction_sum")
            else:
                raise AssertionError(f"es_gradients reads noise only by row and in the direction, not in "
                                     f"{reader.op_type} '{reader.name}'")
            reader.outputs[0].replace_all_uses_with(made)
            indices = reader.inputs[1]
            graph.remove(reader, safe=True)
            while indices is not None and not indices.uses() and indices not in graph.outputs \
                    and (made_it := indices.producer()) is not None and made_it.op_type in ("Expand", "Cast"):
                indices = made_it.inputs[0]  # the row's Expand over the columns, its Cast: read by nothing now
                graph.remove(made_it, safe=True)
        graph.inputs.remove(noise)
        e.anchor = None
        after = e.op("Add", counter, e.scalar(1.0, counter), name=f"{ITERATION}.new")
        keys.set_role(after, Role.OPT_STATE)
        graph.outputs.append(after)
        return ir.passes.PassResult(model, True)
