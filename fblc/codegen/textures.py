"""Textures: which values get one, and the plain row-major texel layout (the layout issue replaces it).

Every tensor is stored flat in an RGBA `image2d_t`: element i sits in lane i % 4 of texel
i // 4, texel t at (x, y) = (t % width, t / width), width = min(texels, the target's image
width). Float tensors use RGBA float (or half with --dtype fp16); integer and boolean tensors
use RGBA int32. Views (Reshape and friends) share their input's texture.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import onnx_ir as ir

from fblc.compiler.errors import FblcError
from fblc.compiler.values import is_float, numel, static_shape
from fblc.passes.fuse import VIEWS
from fblc.profiles import Profile


@dataclass
class Texture:
    id: int
    name: str  # the value it was made for (the root of its views)
    shape: tuple[int, ...]
    kind: str  # "float" or "int"
    format: str  # a key of bundle_format.TEXTURE_FORMATS
    width: int
    height: int
    values: list[str] = field(default_factory=list)  # every value name stored here (views included)

    @property
    def numel(self) -> int:
        return numel(self.shape)

    @property
    def texels(self) -> int:
        return max(1, -(-self.numel // 4))


def view_root(value: ir.Value) -> ir.Value:
    """The value whose texture `value` reads: itself, or the input of the views it comes from."""
    producer = value.producer()
    while producer is not None and producer.op_type in VIEWS and producer.domain == "" and producer.inputs[0] is not None:
        value = producer.inputs[0]
        producer = value.producer()
    return value


class TextureTable:
    """Texture per value root, with the target's image limits checked."""

    def __init__(self, profile: Profile, float_format: str) -> None:
        self.profile = profile
        self.float_format = float_format
        self.textures: list[Texture] = []
        self._by_root: dict[int, Texture] = {}

    def of(self, value: ir.Value) -> Texture:
        root = view_root(value)
        texture = self._by_root.get(id(root))
        if texture is None:
            texture = self._new(root)
            self._by_root[id(root)] = texture
        if value.name not in texture.values:
            texture.values.append(value.name)
        return texture

    def _new(self, value: ir.Value) -> Texture:
        shape = static_shape(value)
        kind = "float" if is_float(value) else "int"
        texels = max(1, -(-numel(shape) // 4))
        width = min(texels, self.profile.image2d_max_width)
        height = -(-texels // width)
        if height > self.profile.image2d_max_height:
            raise FblcError(
                f"tensor '{value.name}' {list(shape)} needs a {width} x {height} texture, beyond {self.profile.name}'s "
                f"image limit of {self.profile.image2d_max_width} x {self.profile.image2d_max_height}",
                "use a smaller batch or sequence, or a target with larger images")
        texture = Texture(len(self.textures), value.name, shape, kind,
                          self.float_format if kind == "float" else "rgba_i32", width, height)
        self.textures.append(texture)
        return texture


def to_texels(array: np.ndarray, texture: Texture) -> np.ndarray:
    """`array` laid out as `texture` stores it: flat, padded with zeros to width * height * 4."""
    dtype = {"rgba_f32": np.float32, "rgba_f16": np.float16, "rgba_i32": np.int32}[texture.format]
    flat = np.zeros(texture.width * texture.height * 4, dtype=dtype)
    with np.errstate(over="ignore"):  # fp16: float32's -3.4e38 mask fill becomes -inf, which softmax reads the same
        flat[: array.size] = np.asarray(array).reshape(-1).astype(dtype)
    return flat


def from_texels(flat: np.ndarray, texture: Texture) -> np.ndarray:
    return np.asarray(flat).reshape(-1)[: texture.numel].reshape(texture.shape)
