"""Choosing an OpenCL device: `local` (the first with image support, PoCL by default) or `opencl:P:D`."""

from __future__ import annotations

import os

from fblc.bundle_format import BundleError

ENV_DEVICE = "FBLC_OPENCL_DEVICE"
NO_DEVICE_HELP = ("install an OpenCL driver (pip install pocl-binary-distribution gives a CPU one; on Debian "
                  "'apt-get install pocl-opencl-icd'), or set FBLC_OPENCL_DEVICE=opencl:P:D")


class DeviceError(BundleError):
    """No usable OpenCL device, or a device string that names none."""


def select_device(spec: str | None = None):  # -> pyopencl.Device
    import pyopencl as cl

    spec = spec or os.environ.get(ENV_DEVICE) or "local"
    try:
        platforms = cl.get_platforms()
    except cl.Error as error:
        raise DeviceError(f"no OpenCL platform found ({error}); {NO_DEVICE_HELP}") from None
    devices = [(p, d) for p in platforms for d in p.get_devices()]
    if spec == "local":
        usable = [d for _, d in devices if d.image_support]
        if not usable:
            raise DeviceError(f"no OpenCL device with image support found; {NO_DEVICE_HELP}")
        return usable[0]
    if spec.startswith("opencl:"):
        try:
            _, platform_index, device_index = spec.split(":")
            device = platforms[int(platform_index)].get_devices()[int(device_index)]
        except (ValueError, IndexError):
            listing = "; ".join(f"opencl:{pi}:{di} = {d.name}" for pi, p in enumerate(platforms)
                                for di, d in enumerate(p.get_devices()))
            raise DeviceError(f"device '{spec}' does not exist; available: {listing or 'none'}") from None
        if not device.image_support:
            raise DeviceError(f"device '{spec}' ({device.name}) has no image support, which fblc's kernels need")
        return device
    raise DeviceError(f"unknown device '{spec}'; use 'local' or 'opencl:PLATFORM:DEVICE' (see 'fblc devices')")


def list_devices() -> list[str]:
    import pyopencl as cl

    try:
        platforms = cl.get_platforms()
    except cl.Error:
        return []
    return [f"opencl:{pi}:{di}  {d.name} ({p.name}, images: {'yes' if d.image_support else 'no'})"
            for pi, p in enumerate(platforms) for di, d in enumerate(p.get_devices())]
