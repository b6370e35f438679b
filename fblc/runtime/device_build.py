"""What an OpenCL device decides of a local run: the storage "auto" picks on it (choose_storage), whether its
kernels build unoptimised (UNOPTIMISED_PLATFORMS, unoptimised_reason), and the build options it takes
(language_standard, device_build_options). LocalRunner asks these; the native runner chooses alike
(native/src/device.c).
"""

from __future__ import annotations

import re
from typing import Any

from fblc import bundle_format as fmt

def choose_storage(storage: str, device: Any) -> tuple[str, str]:
    """(the storage a runner given `storage` uses on `device`, and why when it chose): auto takes buffers on
    a CPU, whose OpenCL images are software (PoCL reads a texel through a library call that stops its
    vectorizer), and images elsewhere, as on a phone."""
    import pyopencl as cl

    if storage != "auto":
        return storage, ""
    name = device.name.strip()
    if device.type & cl.device_type.CPU:
        return "buffer", (f"{name} is a CPU, whose OpenCL images are software: buffers run the same kernels "
                          "several times faster")
    return "image", f"{name} is not a CPU: textures as images, as on a phone"


#: OpenCL platforms whose kernels LocalRunner builds with -cl-opt-disable and outside pyopencl's binary cache,
#: and why (the cache's keys leave out what the platform adds to a build: oclgrind's --build-options)
UNOPTIMISED_PLATFORMS = {
    "Oclgrind": ("oclgrind 21.10 runs some optimised kernels wrongly (it leaves the 2-bit integers LLVM makes of "
                 "lane indices unmasked: the Q.K^T MatMul of a ViT's attention gave wrong numbers)"),
}


def unoptimised_reason(device: Any) -> str:
    """Why LocalRunner builds for `device` without optimisation and outside pyopencl's cache; "" where it does not."""
    return UNOPTIMISED_PLATFORMS.get(device.platform.name.strip(), "")


def language_standard(device: Any) -> str:
    """The -cl-std the kernels build with: OpenCL C 1.2, which every device fblc targets compiles, or on a
    device with sub-groups (cl_khr_subgroups) of OpenCL 2.x / 3.x that version's, whose compilers declare the
    sub-group built-ins the group reductions call (FBLC_SUBGROUPS: clang defines cl_khr_subgroups only from
    OpenCL C 2.0). The native runner chooses alike (device.c, language_standard)."""
    version = re.match(r"OpenCL (\d+)\.", str(device.version))
    major = int(version.group(1)) if version else 1
    if "cl_khr_subgroups" not in str(device.extensions).split() or major < 2:
        return "-cl-std=CL1.2"
    return "-cl-std=CL3.0" if major >= 3 else "-cl-std=CL2.0"


def device_build_options(device: Any) -> list[str]:
    """What the device decides of the kernels' build: its -cl-std (language_standard), then -DFBLC_HALF where
    it lists cl_khr_fp16 (a half kernel's `real` is then half). The native runner's build_options alike."""
    half = [fmt.HALF_BUILD_OPTION] if "cl_khr_fp16" in str(device.extensions).split() else []
    return [language_standard(device), *half]
