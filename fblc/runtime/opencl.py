"""Choosing an OpenCL device: `local` (the first with image support whose compiler builds a kernel, PoCL by
default) or `opencl:P:D`.

`local` builds a one-line probe kernel on each candidate: a driver can list a device whose compiler
fails on this machine (the PoCL 3.0 of the pip wheel, LLVM 14, names a CPU it does not know "generic"
and then rejects it: "unknown target CPU 'generic'", seen on AMD Zen 5), and the next one may work.
"""

from __future__ import annotations

import os

from fblc.bundle_format import BundleError

ENV_DEVICE = "FBLC_OPENCL_DEVICE"
NO_DEVICE_HELP = ("install an OpenCL driver (pip install pocl-binary-distribution gives a CPU one; on Debian "
                  "'apt-get install pocl-opencl-icd'), or set FBLC_OPENCL_DEVICE=opencl:P:D")
PROBE_KERNEL = "__kernel void fblc_probe(__global float *x) { x[get_global_id(0)] += 1.0f; }"
_probed: dict[tuple[str, str, str], str | None] = {}  # (platform, device, driver) -> build error, None if it built


class DeviceError(BundleError):
    """No usable OpenCL device, or a device string that names none."""


def select_device(spec: str | None = None):  # -> pyopencl.Device
    """The device `spec` names; without one, the device FBLC_OPENCL_DEVICE names, else `local`."""
    import pyopencl as cl

    from_environment = not spec and bool(os.environ.get(ENV_DEVICE))
    spec = spec or os.environ.get(ENV_DEVICE) or "local"
    # errors name where the spec came from: a variable set long ago is easily forgotten
    named = f"{ENV_DEVICE}='{spec}'" if from_environment else f"device '{spec}'"
    try:
        platforms = cl.get_platforms()
    except cl.Error as error:
        raise DeviceError(f"no OpenCL platform found ({error}); {NO_DEVICE_HELP}") from None
    devices = [(p, d) for p in platforms for d in p.get_devices()]
    listing = "; ".join(f"opencl:{pi}:{di} = {d.name.strip()}" for pi, p in enumerate(platforms)
                        for di, d in enumerate(p.get_devices())) or "none"
    if spec == "local":
        usable = [d for _, d in devices if d.image_support]
        if not usable:
            raise DeviceError(f"no OpenCL device with image support found; {NO_DEVICE_HELP}")
        working = next((d for d in usable if build_error(d) is None), None)  # probes up to the first that builds
        if working is None:
            failures = "; ".join(f"{d.name.strip()} ({d.platform.version.strip()}): {build_error(d)}" for d in usable)
            raise DeviceError(f"no OpenCL device here can build a kernel: {failures}; {NO_DEVICE_HELP}")
        return working
    if spec.startswith("opencl:"):
        try:
            _, platform_index, device_index = spec.split(":")
            if not (platform_index.isdigit() and device_index.isdigit()):  # int() takes -1, which indexes from the end
                raise ValueError(spec)
            device = platforms[int(platform_index)].get_devices()[int(device_index)]
        except (ValueError, IndexError):
            remedy = f"set {ENV_DEVICE} to one of them, or unset it" if from_environment else "see 'fblc devices'"
            raise DeviceError(f"{named} does not exist; available: {listing}; {remedy}") from None
        if not device.image_support:
            raise DeviceError(f"{named} ({device.name.strip()}) has no image support, which fblc's kernels need")
        return device
    forms = (f"'local' or 'opencl:PLATFORM:DEVICE' (here: {listing}; 'local': the first with images that builds a "
             "kernel)")
    raise DeviceError(f"{named} is not a device fblc knows; "
                      + (f"set {ENV_DEVICE} to {forms}, or unset it" if from_environment else f"use {forms}"))


def build_error(device) -> str | None:  # device: pyopencl.Device
    """The first line of the error `device`'s compiler gives for PROBE_KERNEL, or None if it builds (once a process)."""
    import pyopencl as cl

    key = (device.platform.version, device.name, device.driver_version)
    if key not in _probed:
        try:
            cl.Program(cl.Context([device]), PROBE_KERNEL).build()
            _probed[key] = None
        except cl.Error as error:
            lines = [line.strip() for line in str(error).splitlines() if "error" in line.lower()]
            _probed[key] = (lines[-1] if lines else str(error).strip().splitlines()[0])[:200]
    return _probed[key]


def list_devices() -> list[str]:
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return []
    return [f"opencl:{pi}:{di}  {d.name} ({p.name}, images: {'yes' if d.image_support else 'no'}, "
            f"builds kernels: {'no: ' + error if (error := build_error(d)) else 'yes'})"
            for pi, p in enumerate(platforms) for di, d in enumerate(p.get_devices())]
