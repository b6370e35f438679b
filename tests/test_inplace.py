"""In-place state updates (codegen/inplace.py): the texel proof on kernel IR (golden, negative) and the plans
that follow from it: an ungated update writes over its state (no swap, one texture), a finite-gated one keeps
its pair. The numbers: tests/test_runtime.py's several steps against onnxruntime run these plans."""

from __future__ import annotations

import json
import os

from fblc.codegen import ir as kir
from fblc.codegen.compile import compile_model
from fblc.codegen.cl import Kernel
from fblc.codegen.inplace import in_place_pairs, updates_in_place
from fblc.codegen.ir.expressions import FLOAT4, INT, Binary, Call, Const, Load, Var, div_index
from fblc.codegen.textures import Texture
from fblc.passes.pipeline import TrainingOptions
from fblc.texel_layout import flat_layout
from tests.test_runtime import OPTIONS, elementwise_model

LAYOUT = flat_layout(64, 64)
ITEMS = 60  # work-items of the launch
STATE, NEW = (kir.Argument("in", 0, "float", "float", LAYOUT), kir.Argument("out", 0, "float", "float", LAYOUT))


def _update(read_at, write_at, loop: bool = False) -> kir.KernelIR:
    """new[write_at(g)] = state[read_at(g)] * 0.5, in a loop of 4 repetitions over the same texels if `loop`."""
    g = Var("g", 0, INT, "g")
    body: list = [kir.Declare(g, Call("get_global_id", (Const(0, INT),), INT))]
    update = [kir.Store(NEW, write_at(g), Binary("*", Load(STATE, read_at(g)), Const(0.5, FLOAT4.vector(1)), FLOAT4))]
    body += [kir.For(Var("r", 1, INT, "r"), Const(0, INT), Const(4, INT), update)] if loop else update
    return kir.KernelIR("update", [NEW, STATE], body)


def test_an_update_reading_its_own_texel_is_in_place_and_a_neighbours_is_not() -> None:
    itself = lambda g: g  # noqa: E731
    assert updates_in_place(_update(itself, itself), STATE, NEW, ITEMS)
    assert not updates_in_place(_update(itself, itself), STATE, NEW)  # launch size unknown: nothing proved
    # a tile's row and column put together again: ((g >> 3) * 8 + (g & 7)) is g, and (g / 5) * 5 + g % 5 with
    # the division a reciprocal multiply (ir.div_index)
    rejoined = lambda g: Binary("+", Binary("*", Binary(">>", g, Const(3, INT), INT), Const(8, INT), INT),  # noqa: E731
                                Binary("&", g, Const(7, INT), INT), INT)
    assert updates_in_place(_update(rejoined, itself), STATE, NEW, ITEMS)
    fifths = lambda g: Binary("+", Binary("*", div_index(g, 5), Const(5, INT), INT),  # noqa: E731
                              Binary("-", g, Binary("*", div_index(g, 5), Const(5, INT), INT), INT), INT)
    assert updates_in_place(_update(fifths, itself), STATE, NEW, ITEMS)
    # negative: a neighbour's texel, another work-item's; two work-items on one texel; a repetition re-reading
    assert not updates_in_place(_update(lambda g: Binary("+", g, Const(1, INT), INT), itself), STATE, NEW, ITEMS)
    half = lambda g: Binary(">>", g, Const(1, INT), INT)  # noqa: E731
    assert not updates_in_place(_update(half, half), STATE, NEW, ITEMS)
    assert not updates_in_place(_update(itself, itself, loop=True), STATE, NEW, ITEMS)
    # a variable holding the read, used after the write: the renderer may fold the read into that use
    g, held = Var("g", 0, INT, "g"), Var("h", 101, FLOAT4)  # unnamed: foldable
    late = [kir.Declare(g, Call("get_global_id", (Const(0, INT),), INT)), kir.Declare(held, Load(STATE, g)),
            kir.Store(NEW, g, Const(1.0, FLOAT4.vector(1))), kir.Store(NEW, g, held)]
    assert not updates_in_place(kir.KernelIR("late", [NEW, STATE], late), STATE, NEW, ITEMS)
    assert updates_in_place(kir.KernelIR("early", [NEW, STATE], late[:2] + late[3:]), STATE, NEW, ITEMS)


def _plan(tmp_path, name: str, options: TrainingOptions) -> tuple[dict, dict[str, int]]:
    out = str(tmp_path / name)
    compile_model(elementwise_model(str(tmp_path / "model.onnx")), out, "adreno830", "fp32", options)
    plan = json.load(open(os.path.join(out, "plan.json")))
    return plan, {value: texture["id"] for texture in plan["textures"] for value in texture["values"]}


def test_an_ungated_update_has_no_swap_and_a_gated_one_keeps_its_pair(tmp_path) -> None:
    plan, texture_of = _plan(tmp_path, "plain", OPTIONS)
    for state in ("w", "b", "w.exp_avg", "b.exp_avg_sq"):
        assert texture_of[state] == texture_of[f"{state}.new"], state  # written over the state
    assert not {texture_of["w"], texture_of["b"]} & {t for pair in plan["swaps"] for t in pair}
    gated, texture_of = _plan(tmp_path, "gated", TrainingOptions(loss="mse", optimizer=OPTIONS.optimizer,
                                                                 loss_scale="dynamic"))
    pairs = gated["swaps_if_finite"]["pairs"]
    for state in ("w", "b", "w.exp_avg"):  # a skipped step must keep the old value: two textures, swapped
        assert [texture_of[state], texture_of[f"{state}.new"]] in pairs and \
            texture_of[state] != texture_of[f"{state}.new"], state


def test_an_update_moves_after_a_later_reader_of_the_old_state_where_nothing_between_depends_on_it() -> None:
    """An input gradient that reads a weight after the weight gradient's kernel wrote its update (SGD fused
    there): the update goes after that reader, and writes over the weight. Where a launch between writes what
    the update reads, it stays, and keeps its pair."""
    textures = [Texture(t, f"t{t}", (ITEMS,), "float", "rgba_f32", LAYOUT) for t in range(4)]
    update = _update(lambda g: g, lambda g: g)

    def launches(between_writes: int) -> list[Kernel]:  # 0: the state, 1: its .new, 2: the gradient
        return [Kernel("k1_update", "elementwise", update, ITEMS, outputs=[1], inputs=[0, 2]),
                Kernel("k2_other", "elementwise", update, ITEMS, outputs=[between_writes], inputs=[3]),
                Kernel("k3_reader", "elementwise", update, ITEMS, outputs=[3], inputs=[0])]

    kernels = launches(between_writes=3)
    assert in_place_pairs(kernels, textures, [(0, 1)], set(), set()) == [(0, 1)]
    assert [k.name for k in kernels] == ["k2_other", "k3_reader", "k1_update"]
    kernels = launches(between_writes=2)  # writes the update's input: it must run before
    assert in_place_pairs(kernels, textures, [(0, 1)], set(), set()) == []
    assert [k.name for k in kernels] == ["k1_update", "k2_other", "k3_reader"]
    kernels = launches(between_writes=3)  # a plan loop between: its launch range would shift
    assert in_place_pairs(kernels, textures, [(0, 1)], set(), {1}) == [] and kernels[0].name == "k1_update"
    # two weights each read by the other's gradient (y = a @ b): a's update goes after b's, which then may not
    # move after a's (it would read a overwritten): b keeps its pair
    kernels = [Kernel("k4_a_grad", "matmul", update, ITEMS, outputs=[1], inputs=[0, 4, 2]),  # the state first: in0
               Kernel("k5_b_grad", "matmul", update, ITEMS, outputs=[3], inputs=[2, 0, 4])]
    pairs = [(0, 1), (2, 3)]
    textures = [Texture(t, f"t{t}", (ITEMS,), "float", "rgba_f32", LAYOUT) for t in range(5)]
    assert in_place_pairs(kernels, textures, pairs, set(), set()) == [(0, 1)]
    assert [k.name for k in kernels] == ["k5_b_grad", "k4_a_grad"]
