"""Kernel variables come from one vocabulary (fblc.codegen.builder.KERNEL_NAMES) or `fresh()`.

Every name that the kernels of real bundles (T-ResNet, the Llama decoder, MobileNetV2) declare,
as a variable, a loop counter or an argument, must be in the table, be a numbered fresh name
(hint + number), or be one of the preamble's own; a name outside them fails with the kernel.
"""

from __future__ import annotations

import re

import pytest

from fblc.codegen.builder import KERNEL_NAMES
from fblc.codegen.cl import PREAMBLE
from fblc.codegen.compile import compile_model
from fblc.passes.pipeline import TrainingOptions

DECLARED = re.compile(r"\b(?:const\s+)?(?:u?int[24]?|float[24]?|__local float|(?:read|write)_only image2d_t)\s+"
                      r"([A-Za-z_]\w*)\s*(?=[=\[;,)])")
FRESH = re.compile(r"^[A-Za-z]+\d+$")  # fresh(hint): a hint and a number


def allowed(name: str, preamble: set[str]) -> bool:
    if name in KERNEL_NAMES or name in preamble or FRESH.match(name):
        return True
    stem = name.rstrip("0123456789")
    return stem != name and f"{stem}<k>" in KERNEL_NAMES


def test_an_unlisted_name_is_refused() -> None:
    preamble = set(DECLARED.findall(PREAMBLE))
    assert allowed("o3", preamble) and allowed("acc12", preamble) and allowed("lane", preamble)
    assert not allowed("tmp", preamble) and not allowed("index", preamble)


@pytest.mark.parametrize("model", ["tresnet", "llama", "mobilenet_v2", "llama-fura-s-es"])
def test_every_declared_name_is_in_the_vocabulary(tmp_path, model: str) -> None:
    from support import models

    from fblc.compiler.adapters import AdapterConfig

    exported = {"tresnet": models.tresnet, "llama": lambda d: models.llama(d)[1], "mobilenet_v2": models.mobilenet_v2,
                "llama-fura-s-es": lambda d: models.llama(d)[0]}[model](str(tmp_path))
    options = TrainingOptions(input_shapes=exported.input_shapes)
    if model.endswith("-es"):  # the noise kernels
        options = TrainingOptions(trainer="es", adapter=AdapterConfig(kind="fura-s", block=16))
    bundle = tmp_path / "bundle"
    compile_model(exported.path, str(bundle), "adreno830", "fp32", options)
    source = (bundle / "kernels.cl").read_text()
    preamble = set(DECLARED.findall(PREAMBLE))
    outside: dict[str, str] = {}
    for kernel in re.split(r"(?=__kernel void )", source)[1:]:
        for name in DECLARED.findall(kernel):
            if not allowed(name, preamble):
                outside.setdefault(name, kernel.split("(")[0])
    assert outside == {}, f"names outside fblc.codegen.builder.KERNEL_NAMES: {outside}"
