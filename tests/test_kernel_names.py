"""Kernel variables come from one vocabulary (fblc.codegen.builder.KERNEL_NAMES) or `fresh()`.

Every name that the kernels of real bundles (T-ResNet, the Llama decoder, MobileNetV2) declare,
as a variable, a loop counter or an argument, must be in the table, be a numbered fresh name
(hint + number), or be one of the preamble's own; a name outside them fails with the kernel.
The same kernels divide no integer: their index arithmetic is shifts, masks and reciprocal
multiplies (the old MobileNetV2 bundle had 1,434 integer declarations that divided).
"""

from __future__ import annotations

import re

import pytest

from fblc.codegen.builder import KERNEL_NAMES
from fblc.codegen.cl import PREAMBLE
from fblc.codegen.compile import compile_model
from fblc.passes.pipeline import TrainingOptions

DECLARED = re.compile(r"\b(?:const\s+)?(?:u?int[24]?|float[24]?|__local float\*?|(?:read|write)_only image2d_t)\s+"
                      r"([A-Za-z_]\w*)\s*(?=[=\[;,)])|\bIMAGE_(?:IN|OUT)\(\w+, ([A-Za-z_]\w*)\)")


def declared(text: str) -> list[str]:
    """The names `text` declares: variables, and kernel arguments (IMAGE_IN / IMAGE_OUT, or image2d_t)."""
    return [match.group(1) or match.group(2) for match in DECLARED.finditer(text)]


FRESH = re.compile(r"^[A-Za-z]+\d+$")  # fresh(hint): a hint and a number


def allowed(name: str, preamble: set[str]) -> bool:
    if name in KERNEL_NAMES or name in preamble or FRESH.match(name):
        return True
    stem = name.rstrip("0123456789")
    return stem != name and f"{stem}<k>" in KERNEL_NAMES


def test_an_unlisted_name_is_refused() -> None:
    preamble = set(declared(PREAMBLE))
    assert allowed("o3", preamble) and allowed("acc12", preamble) and allowed("lane", preamble)
    assert not allowed("tmp", preamble) and not allowed("index", preamble)


MODELS = ["tresnet", "llama", "mobilenet_v2", "llama-fura-s-es"]
#: an integer declaration whose value divides: `const int a = b / c;` (float ones are `float`)
INTEGER_DIVISION = re.compile(r"\b(?:const\s+)?u?int\s+\w+\s*=[^;]*[\w)\]]\s*[/%]\s*[\w(]")


@pytest.fixture(scope="module", params=MODELS)
def kernels_of(request, tmp_path_factory) -> str:
    """kernels.cl of a real bundle (the Llama decoder also as an ES bundle, for the noise kernels)."""
    from support import models

    from fblc.compiler.adapters import AdapterConfig
    from fblc.compiler.es import EsConfig

    model, directory = request.param, tmp_path_factory.mktemp(request.param)
    exported = {"tresnet": models.tresnet, "llama": lambda d: models.llama(d)[1], "mobilenet_v2": models.mobilenet_v2,
                "llama-fura-s-es": lambda d: models.llama(d)[0]}[model](str(directory))
    options = TrainingOptions(input_shapes=exported.input_shapes)
    if model.endswith("-es"):  # the noise kernels (4 pairs: the paper's 15 clone the forward 30 times, same kernels)
        options = TrainingOptions(trainer="es", adapter=AdapterConfig(kind="fura-s", block=16), es=EsConfig(pairs=4))
    bundle = directory / "bundle"
    compile_model(exported.path, str(bundle), "adreno830", "fp32", options)
    return (bundle / "kernels.cl").read_text()


def test_every_declared_name_is_in_the_vocabulary(kernels_of: str) -> None:
    source = kernels_of
    preamble = set(declared(PREAMBLE))
    outside: dict[str, str] = {}
    for kernel in re.split(r"(?=__kernel void )", source)[1:]:
        for name in declared(kernel):
            if not allowed(name, preamble):
                outside.setdefault(name, kernel.split("(")[0])
    assert outside == {}, f"names outside fblc.codegen.builder.KERNEL_NAMES: {outside}"


def test_no_kernel_divides_an_integer(kernels_of: str) -> None:
    """Index arithmetic is shifts, masks and reciprocal multiplies (fblc.codegen.cl.div_index): no
    integer declaration in a kernel divides or takes a remainder."""
    assert INTEGER_DIVISION.search("const int a = (b + 1) / 3;") and not INTEGER_DIVISION.search(
        "const float a = b / 3.0f;")
    body = kernels_of[kernels_of.index("__kernel void "):]
    dividing = [line.strip() for line in body.splitlines() if INTEGER_DIVISION.search(line.split("//")[0])]
    assert dividing == [], "\n".join(dividing[:10])
