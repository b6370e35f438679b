"""Co-launched kernels (fblc/codegen/co_launch.py): which launches merge, and what the merged kernel runs. The numbers
of steps with co-launched kernels are checked on PoCL by test_device_models (adreno830: mlp, llama, tresnet,
mobilenet_v2) and on oclgrind, races included, by test_oclgrind."""

from __future__ import annotations

from fblc.codegen import ir as kir
from fblc.codegen.cl import Kernel
from fblc.codegen.co_launch import co_launch
from fblc.codegen.plan import share_kernels
from fblc.codegen.render.opencl import BUFFER
from fblc.codegen.render.source import assemble_source
from fblc.profiles import load_profile

ADRENO = load_profile("adreno830")


def _kernel(name: str, items: int, inputs: list[int], outputs: list[int], group: int | None = None) -> Kernel:
    """A kernel writing its work-item's id: enough IR to see each part's ids."""
    numbering = kir.Numbering()
    body = kir.Block(numbering)
    item = body.let(kir.call("get_group_id" if group else "get_global_id", 0, dtype=kir.INT), "t")
    arguments = [kir.Argument("out", k, "float", "float4", None) for k in range(len(outputs))]
    arguments += [kir.Argument("in", k, "float", "float4", None) for k in range(len(inputs))]
    body.add(kir.If(item.ge(items // (group or 1)), [kir.Return()]))
    if group:
        body.array("shared", kir.FLOAT, group, local=True, name="shared")
    return Kernel(name, "elementwise", kir.KernelIR(name, arguments, body.statements, group), items, outputs, inputs,
                  group_size=group)


def test_independent_neighbours_share_a_launch_and_dependent_ones_do_not() -> None:
    first, reader, other = _kernel("k1", 100, [0], [1]), _kernel("k2", 50, [1], [2]), _kernel("k3", 30, [0], [3])
    launches = co_launch([first, reader, other], ADRENO, looped=False)
    assert [k.name for k in launches] == ["k1", "k2_k3"]  # k2 reads k1's output; k3 reads only what k1 reads
    merged = launches[1]
    assert merged.parts == [reader, other] and merged.outputs == [2, 3] and merged.inputs == [1, 0]
    assert merged.global_size == 64 + 30  # k2's 50 work-items take a whole wave before k3's
    source = merged.render(BUFFER)
    assert "(get_global_id(0) - 64)" in source and "out1" in source and "in1" in source
    assert [k.name for k in co_launch([first, reader, other], load_profile("local"), looped=False)] == [
        "k1", "k2", "k3"]  # a CPU's profile: left alone
    assert len(co_launch([first, other], ADRENO, looped=True)) == 2  # an ES loop indexes the launches


def test_group_kernels_join_only_their_size() -> None:
    any_size = _kernel("k1", 100, [0], [1])
    small_groups, wave_groups = _kernel("k2", 64, [0], [2], group=4), _kernel("k3", 128, [0], [3], group=64)
    assert len(co_launch([any_size, small_groups], ADRENO, looped=False)) == 2  # groups of 4 would idle lanes
    both = co_launch([wave_groups, _kernel("k4", 128, [0], [4], group=64)], ADRENO, looped=False)
    assert [k.name for k in both] == ["k3_k4"] and both[0].group_size == 64
    source = both[0].render(BUFFER)
    assert "if (get_group_id(0) < 2)" in source and "(get_group_id(0) - 2)" in source
    assert "__local float shared_1[64];" in source  # __local arrays at the kernel's scope, named apart



def test_the_source_holds_each_part_once_and_the_launches_call_it() -> None:
    """A part without barriers is one function in the source (render/source.py): the co-launched __kernel calls it
    over its range (its ids less its start), and a launch of its own with the same IR (plan.share_kernels' twin) is
    a __kernel calling the same function. A part with barriers leaves its function by its end only
    (co_launch.one_exit: PoCL's -O0 build ran a group reduction wrong after an early return) and is inlined by the
    device compiler's front end (KernelIR.inlined: PoCL's own inlining built it 2.8x slower); a part whose return
    is not a guard at its body's top level stays copied into the pair (co_launch.dispatched)."""
    first, reader, other = _kernel("k1", 100, [0], [1]), _kernel("k2", 50, [1], [2]), _kernel("k3", 30, [0], [3])
    twin = _kernel("k4", 30, [0], [3])  # k3's IR: the same arguments and body
    kernels = co_launch([first, reader, other], ADRENO, looped=False) + [twin]
    share_kernels(kernels)
    source, spans = assemble_source(kernels, [], BUFFER)
    assert source.count("void k2_part(") == source.count("void k3_part(") == 1 and "k4_part" not in source
    assert "k2_part(out0, in0, 0);" in source and "k3_part(out1, in1, 64);" in source  # k2_k3's ranges
    assert "__kernel void k4(" in source and "k3_part(out0, in0, 0);" in source
    assert "(get_global_id(0) - first_item)" in source and "void k1_part" not in source  # k1 stays a __kernel
    first_line, last_line = spans["k2_k3"]
    assert "void k2_part(" in source.splitlines()[first_line]  # a build error there names the pair
    barrier = _kernel("k5", 128, [0], [4], group=64)
    barrier.ir.body.append(kir.Barrier())
    grouped = co_launch([barrier, _kernel("k6", 128, [0], [5], group=64)], ADRENO, looped=False)
    share_kernels(grouped)
    source, _ = assemble_source(grouped, [], BUFFER)
    k5, k6 = source[source.index("void k5_part("):source.index("void k6_part(")], source[source.index("void k6_part("):]
    assert "return;" not in k5 and "if ((get_group_id(0) - first_group) < 2) {" in k5 and "barrier(" in k5
    assert "return;" in k6  # no barrier: its guard as it was
    inlined = "inline __attribute__((always_inline)) void"
    assert f"{inlined} k5_part(" in source and f"{inlined} k6_part(" not in source
    assert "restrict" not in k5.splitlines()[0] and "restrict" in k6.splitlines()[0]  # oclgrind: no scope decls
    assert "k5_part(out0, in0, 0, shared);" in source and "k6_part(out1, in1, 2, shared_1);" in source
    looped = _kernel("k7", 128, [0], [4], group=64)  # a return inside a loop: no single exit to write
    looped.ir.body[1:2] = [kir.For(kir.Var("i", 1, kir.INT), kir.const(0), kir.const(2), [looped.ir.body[1]])]
    looped.ir.body.append(kir.Barrier())
    grouped = co_launch([looped, _kernel("k8", 128, [0], [5], group=64)], ADRENO, looped=False)
    share_kernels(grouped)
    source, _ = assemble_source(grouped, [], BUFFER)
    assert "_part" not in source and "(get_group_id(0) - 2)" in source
