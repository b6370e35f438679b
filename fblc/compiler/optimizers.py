"""Optimizer updates as ONNX ops, by table; state tensors are graph values with role `opt_state`.

Each update follows torch.optim's formula for the same hyper-parameters, so that a step of
the training graph matches a step of PyTorch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np
import onnx_ir as ir

from fblc import choices
from fblc.errors import FblcError
from fblc.compiler.graph import Emitter


@dataclass(frozen=True)
class OptimizerConfig:
    name: str = "sgd"
    lr: float = choices.LR
    momentum: float = 0.0
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8


@dataclass
class StateTensor:
    """One optimizer-state tensor: its name, its initial value, and the value of its update."""

    name: str
    initial: Callable[[], np.ndarray]  # made only when the value is needed (saving the step)
    shape: tuple[int, ...]
    dtype: np.dtype
    value: ir.Value | None = None  # the graph input, set by the caller
    new: ir.Value | None = None


def _zeros(name: str, shape: tuple[int, ...], dtype: np.dtype) -> StateTensor:
    return StateTensor(name, lambda: np.zeros(shape, dtype), tuple(shape), np.dtype(dtype))


StateFactory = Callable[[OptimizerConfig, str, tuple[int, ...], np.dtype], list[StateTensor]]
Update = Callable[[Emitter, OptimizerConfig, ir.Value, ir.Value, list[StateTensor], dict[str, ir.Value]], ir.Value]


SharedUpdate = Callable[[Emitter, OptimizerConfig, list[StateTensor]], dict[str, ir.Value]]


@dataclass(frozen=True)
class OptimizerSpec:
    per_param_state: StateFactory
    shared_state: Callable[[], list[StateTensor]]
    shared_update: SharedUpdate  # once per step, before the parameters' updates
    update: Update


def _sgd_state(cfg: OptimizerConfig, param: str, shape: tuple[int, ...], dtype: np.dtype) -> list[StateTensor]:
    return [_zeros(f"{param}.momentum", shape, dtype)] if cfg.momentum else []


def _sgd_update(e: Emitter, cfg: OptimizerConfig, param: ir.Value, grad: ir.Value, state: list[StateTensor],
                shared: dict[str, ir.Value]) -> ir.Value:
    """torch.optim.SGD (dampening 0, no nesterov): buf = momentum*buf + g; p -= lr*buf."""
    g = grad
    if cfg.weight_decay:
        g = e.op("Add", g, e.op("Mul", param, e.scalar(cfg.weight_decay, param)))
    if cfg.momentum:
        (buf,) = state
        g = e.op("Add", e.op("Mul", buf.value, e.scalar(cfg.momentum, param)), g)
        buf.new = g
    return e.op("Sub", param, e.op("Mul", g, e.scalar(cfg.lr, param)))


def _adam_state(cfg: OptimizerConfig, param: str, shape: tuple[int, ...], dtype: np.dtype) -> list[StateTensor]:
    return [_zeros(f"{param}.exp_avg", shape, dtype), _zeros(f"{param}.exp_avg_sq", shape, dtype)]


def _adam_step_state() -> list[StateTensor]:
    return [_zeros("optimizer.step", (), np.dtype(np.float32))]


def _adam_shared(e: Emitter, cfg: OptimizerConfig, shared_states: list[StateTensor]) -> dict[str, ir.Value]:
    """Once per step: the step count and the bias corrections every parameter's update reads."""
    (step_state,) = shared_states
    assert step_state.value is not None
    step = e.op("Add", step_state.value, e.scalar(1.0, step_state.value))
    step_state.new = step
    correction1 = e.op("Sub", e.scalar(1.0, step), e.op("Pow", e.scalar(cfg.beta1, step), step))
    correction2 = e.op("Sub", e.scalar(1.0, step), e.op("Pow", e.scalar(cfg.beta2, step), step))
    return {"step_size": e.op("Div", e.scalar(cfg.lr, step), correction1),
            "inv_sqrt_correction2": e.op("Reciprocal", e.op("Sqrt", correction2))}


def _no_shared(e: Emitter, cfg: OptimizerConfig, shared_states: list[StateTensor]) -> dict[str, ir.Value]:
    return {}


def _adam_like(decoupled: bool) -> Update:
    def update(e: Emitter, cfg: OptimizerConfig, param: ir.Value, grad: ir.Value, state: list[StateTensor],
               shared: dict[str, ir.Value]) -> ir.Value:
        """torch.optim.Adam / AdamW: p -= step_size * m / (sqrt(v) / sqrt(correction2) + eps)."""
        exp_avg, exp_avg_sq = state
        step_size, inv_sqrt_correction2 = shared["step_size"], shared["inv_sqrt_correction2"]
        if param.dtype != step_size.dtype:
            step_size = e.op("Cast", step_size, to=param.dtype)
            inv_sqrt_correction2 = e.op("Cast", inv_sqrt_correction2, to=param.dtype)
        g = grad
        p = param
        if cfg.weight_decay and decoupled:
            p = e.op("Mul", param, e.scalar(1.0 - cfg.lr * cfg.weight_decay, param))
        elif cfg.weight_decay:
            g = e.op("Add", g, e.op("Mul", param, e.scalar(cfg.weight_decay, param)))
        m = e.op("Add", e.op("Mul", exp_avg.value, e.scalar(cfg.beta1, param)),
                 e.op("Mul", g, e.scalar(1.0 - cfg.beta1, param)))
        v = e.op("Add", e.op("Mul", exp_avg_sq.value, e.scalar(cfg.beta2, param)),
                 e.op("Mul", e.op("Mul", g, g), e.scalar(1.0 - cfg.beta2, param)))
        exp_avg.new, exp_avg_sq.new = m, v
        denom = e.op("Add", e.op("Mul", e.op("Sqrt", v), inv_sqrt_correction2), e.scalar(cfg.eps, param))
        return e.op("Sub", p, e.op("Mul", step_size, e.op("Div", m, denom)))

    return update


OPTIMIZERS: dict[str, OptimizerSpec] = {
    "sgd": OptimizerSpec(_sgd_state, list, _no_shared, _sgd_update),
    "adam": OptimizerSpec(_adam_state, _adam_step_state, _adam_shared, _adam_like(decoupled=False)),
    "adamw": OptimizerSpec(_adam_state, _adam_step_state, _adam_shared, _adam_like(decoupled=True)),
}


def optimizer_spec(name: str) -> OptimizerSpec:
    if name not in OPTIMIZERS:
        raise FblcError(f"unknown optimizer '{name}'", f"choose one of: {', '.join(OPTIMIZERS)}")
    return OPTIMIZERS[name]
