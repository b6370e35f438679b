"""The fuzzer: random graphs through the training step, its gradients and kernels; broken files through the import.

    python -m fblc.tools.fuzz [--graphs 300] [--seed 0] [--device-every 20] [--mutations 200] [--keep DIR]

Each random classifier (fblc/tools/random_graphs.py) goes through five stages, a finding
naming the seed and the stage where one fails:
- `build`: `fblc train-graph`'s pipeline builds the step (every op the generator uses is
  supported, so any error is a finding);
- `loss`: onnxruntime runs the step; its loss equals the cross-entropy of the original model's
  forward in float64 (1e-5);
- `gradient`: each `P.grad` against central finite differences of that forward's loss along
  its own direction (each parameter alone), and all of them along one random direction, within
  1 % of |grad| + 1e-4. The forward runs in float64, on onnxruntime where it has double kernels
  for all the ops, else on onnx's reference evaluator; of its two step sizes (1e-4, 1e-6) one
  agrees, so a kink of Relu/Max/MaxPool 1e-4 away is stepped over;
- `mode`: the step under the graph's training mode (MODES, drawn per graph from its seed: adapter,
  trainer, optimizer, BatchNorm mode) builds and runs on onnxruntime; its loss is the forward's
  where the mode leaves the model as it is (every adapter starts at the identity, an ES step's loss
  is the unperturbed model's; training-mode BatchNorm normalises by the batch instead);
- `device` (every `--device-every`-th graph): that step's bundle, in the graph's dtype, storage
  and layout (also MODES), runs one step on the local OpenCL device against onnxruntime
  (fblc.tools.verify's flow; fp32 within its tolerances, fp16 within FP16_SCALED_TOLERANCE of
  each tensor's largest magnitude).
Mutations of a valid model file (truncated, bytes flipped, a dangling input, a cycle, a type
that cannot be, an unknown op, an attribute of the wrong type, an empty graph) must load and
build into a step or raise an FblcError, a clear error: any other exception is a `crash` finding.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import traceback
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, replace

import numpy as np
import onnx

from fblc.compiler import keys
from fblc.compiler.keys import Role
from fblc.compiler.adapters import ADAPTERS, MEMORY_FLOOR_ADAPTERS, AdapterConfig
from fblc.compiler.es import TRAINERS
from fblc.compiler.model_io import load_model, save_model_atomically
from fblc.compiler.optimizers import OPTIMIZERS, OptimizerConfig
from fblc.compiler.reference import ReferenceStep, onnxruntime_session, run_model
from fblc.errors import FblcError
from fblc.passes.pipeline import LAYOUTS, TrainingOptions, build_training_graph
from fblc.tools.mutations import mutant
from fblc.tools.random_graphs import RandomGraph, random_graph

OPTIONS = TrainingOptions(optimizer=OptimizerConfig("sgd", lr=0.01))
#: the training modes a graph is checked under, one value of each drawn per graph from its seed; the
#: last three matter on the device only
MODES: dict[str, tuple[str, ...]] = {
    "adapter": tuple(ADAPTERS), "trainer": tuple(TRAINERS), "optimizer": tuple(OPTIMIZERS),
    "batchnorm": ("eval", "train"), "dtype": ("fp32", "fp16"), "storage": ("image", "buffer"), "layout": tuple(LAYOUTS),
}
#: combinations fblc refuses by design (an FblcError naming both), drawn again
REFUSED: list[dict[str, str]] = [{"adapter": "memflora-sg", "trainer": "es"},  # its replay needs the backward
                                 {"optimizer": "adamw", "trainer": "es"},  # ES steps with SGD or Adam
                                 # the memory floor folds BatchNorm into a fixed affine map
                                 *({"adapter": kind, "batchnorm": "train"} for kind in MEMORY_FLOOR_ADAPTERS)]
#: adapters whose sites are Conv layers of groups 1: their graphs start with one
CONV_ADAPTERS = ("memflora", "memflora-sg")
Mode = dict[str, str]
LOSS_RTOL = 1e-5
GRADIENT_RTOL, GRADIENT_ATOL = 1e-2, 1e-4
STEP_SIZES = (1e-4, 1e-6)  # tried in turn until one agrees: a kink rarely lies within both


@dataclass
class Finding:
    seed: int
    stage: str
    message: str

    def __str__(self) -> str:
        return f"seed {self.seed}, {self.stage}: {self.message}"


def _loss(logits: np.ndarray, labels: np.ndarray) -> float:
    z = logits.astype(np.float64)
    z = z - z.max(axis=1, keepdims=True)
    log_p = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    return float(-log_p[np.arange(len(labels)), labels].mean())


def draw_mode(seed: int) -> Mode:
    """Graph `seed`'s training mode: one value per MODES entry, no REFUSED combination."""
    rng = np.random.default_rng(seed + 2_000_003)
    while True:
        mode = {name: str(values[rng.integers(len(values))]) for name, values in MODES.items()}
        if not any(all(mode[k] == v for k, v in refused.items()) for refused in REFUSED):
            return mode


def graph_of(seed: int) -> RandomGraph:
    """Random graph `seed`, fit for its mode: a Conv site for CONV_ADAPTERS, a BatchNorm to train on the batch."""
    mode = draw_mode(seed)
    return random_graph(seed, conv_site=mode["adapter"] in CONV_ADAPTERS, batchnorm=mode["batchnorm"] == "train")


def mode_options(mode: Mode) -> TrainingOptions:
    """The TrainingOptions of `mode` (dtype, storage and layout are the device stage's)."""
    optimizer = OptimizerConfig(mode["optimizer"], lr=0.01)
    # rank 1: a linear site as narrow as one feature (a Flatten of [N, 1]) takes an adapter too
    return replace(OPTIONS, optimizer=optimizer, adapter=AdapterConfig(mode["adapter"], rank=1),
                   trainer=mode["trainer"], bn_train=mode["batchnorm"] == "train", layout=mode["layout"])


def _in_float64(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    """`model` in float64, its parameters graph inputs (and its Casts to float Casts to double)."""
    m = onnx.ModelProto.FromString(model.SerializeToString())
    for tensor in m.graph.initializer:
        if tensor.data_type == onnx.TensorProto.FLOAT:
            array = onnx.numpy_helper.to_array(tensor).astype(np.float64)
            tensor.CopyFrom(onnx.numpy_helper.from_array(array, tensor.name))
            if tensor.name in params:
                m.graph.input.append(onnx.helper.make_tensor_value_info(tensor.name, onnx.TensorProto.DOUBLE,
                                                                       array.shape))
    for value in (*m.graph.input, *m.graph.output):
        if value.type.tensor_type.elem_type == onnx.TensorProto.FLOAT:
            value.type.tensor_type.elem_type = onnx.TensorProto.DOUBLE
    for node in m.graph.node:
        for attribute in node.attribute:
            if node.op_type == "Cast" and attribute.name == "to" and attribute.i == onnx.TensorProto.FLOAT:
                attribute.i = onnx.TensorProto.DOUBLE
            if node.op_type == "Constant" and attribute.t.data_type == onnx.TensorProto.FLOAT:
                attribute.t.CopyFrom(onnx.numpy_helper.from_array(
                    onnx.numpy_helper.to_array(attribute.t).astype(np.float64), attribute.t.name))
    return m


class _Forward:
    """The original model's loss as a function of its parameters, in float64 so that finite differences
    see no rounding: on onnxruntime where it has double kernels for every op, else on onnx's reference
    evaluator (numpy, slower, every op in double)."""

    def __init__(self, model: onnx.ModelProto, params: list[str], feeds: dict[str, np.ndarray],
                 labels: np.ndarray) -> None:
        self.feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in feeds.items()}
        self.labels = labels
        double = _in_float64(model, params)
        self.initial = {t.name: onnx.numpy_helper.to_array(t) for t in double.graph.initializer if t.name in params}
        try:
            session = onnxruntime_session(double)
            self.run: Callable[[dict[str, np.ndarray]], np.ndarray] = lambda feeds: session.run(None, feeds)[0]
            self()
        except Exception:  # no double kernel for some op (Conv, pools, Erf)
            from onnx.reference import ReferenceEvaluator

            evaluator = ReferenceEvaluator(double)
            self.run = lambda feeds: evaluator.run(None, feeds)[0]

    def __call__(self, params: dict[str, np.ndarray] | None = None) -> float:
        """The loss at the initial parameters, those of `params` replaced."""
        values = {**self.initial, **(params or {})}
        return _loss(self.run({**self.feeds, **{k: np.asarray(v, np.float64) for k, v in values.items()}}), self.labels)


def _gradient_error(forward: _Forward, grads: dict[str, np.ndarray],
                    rng: np.random.Generator) -> str | None:
    """None when, for every parameter on its own, the step's gradient agrees with central finite
    differences of the forward's loss along that gradient's direction (so a small gradient is not
    judged against the largest) and along one random direction over all parameters."""
    initial = forward.initial
    grads64 = {k: g.astype(np.float64) for k, g in grads.items()}
    random = {k: rng.standard_normal(g.shape) for k, g in grads.items()}
    random_norm = float(np.sqrt(sum(float((v ** 2).sum()) for v in random.values())))
    checks = [(f"'{name}''s gradient", {name: g / float(np.linalg.norm(g))}) for name, g in grads64.items()
              if np.linalg.norm(g) > 0]
    checks.append(("a random", {k: v / random_norm for k, v in random.items()}))
    for label, direction in checks:
        analytic = sum(float((grads64[k] * d).sum()) for k, d in direction.items())
        scale = float(np.sqrt(sum(float((grads64[k] ** 2).sum()) for k in direction)))
        errors = []
        for eps in STEP_SIZES:
            plus = forward({k: initial[k] + eps * d for k, d in direction.items()})
            minus = forward({k: initial[k] - eps * d for k, d in direction.items()})
            errors.append((plus - minus) / (2 * eps) - analytic)
            if abs(errors[-1]) <= GRADIENT_RTOL * scale + GRADIENT_ATOL:
                break
        error = min(errors, key=abs)
        if abs(error) > GRADIENT_RTOL * scale + GRADIENT_ATOL:
            return (f"along {label} direction the step's gradient gives {analytic:.6g}, finite differences "
                    f"{analytic + error:.6g} (|grad| {scale:.3g})")
    return None


def check_graph(seed: int, workdir: str, device: bool = False) -> tuple[RandomGraph, list[Finding]]:
    """The stages of the module docstring for random graph `seed`, under its mode `draw_mode(seed)`."""
    mode = draw_mode(seed)
    graph = graph_of(seed)
    rng = np.random.default_rng(seed + 1_000_003)
    feeds = graph.feeds(rng)
    labels = rng.integers(0, graph.classes, graph.batch).astype(np.int64)
    path = os.path.join(workdir, f"fuzz_{seed}.onnx")
    onnx.save(graph.model, path)

    def finding(stage: str, message: str) -> tuple[RandomGraph, list[Finding]]:
        return graph, [Finding(seed, stage, message)]

    def first_line(error: Exception) -> str:
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"

    try:
        step = build_training_graph(load_model(path), OPTIONS)
    except Exception as error:  # any: every op is supported, a refusal is a finding too
        return finding("build", first_line(error))
    step_path = os.path.join(workdir, f"fuzz_{seed}_step.onnx")
    save_model_atomically(step, step_path)
    params = [v.name for v in step.graph.inputs if keys.get_role(v) == Role.PARAM.value]
    outputs = run_model(onnx.load(step_path), {**feeds, "labels": labels})
    forward = _Forward(graph.model, params, feeds, labels)
    expected = forward()
    if not np.isclose(float(outputs["loss"]), expected, rtol=LOSS_RTOL, atol=LOSS_RTOL):
        return finding("loss", f"step loss {float(outputs['loss']):.7g}, forward cross-entropy {expected:.7g}")
    message = _gradient_error(forward, {p: outputs[f"{p}.grad"] for p in params}, rng)
    if message:
        return finding("gradient", message)
    options = mode_options(mode)
    stage = "mode (" + ", ".join(f"{mode[k]}" for k in ("adapter", "trainer", "optimizer", "batchnorm")) + ")"
    try:
        mode_step = build_training_graph(load_model(path), options)
        mode_path = os.path.join(workdir, f"fuzz_{seed}_mode.onnx")
        save_model_atomically(mode_step, mode_path)
        reference = ReferenceStep(mode_path)
        loss = reference.step({**feeds, "labels": labels})
    except Exception as error:  # any: every mode applies to every graph (CONV_ADAPTERS get a conv)
        return finding(stage, first_line(error))
    batch_statistics = options.bn_train and "BatchNormalization" in graph.ops
    if not batch_statistics and not np.isclose(loss, expected, rtol=LOSS_RTOL, atol=LOSS_RTOL):
        return finding(stage, f"step loss {loss:.7g}, forward cross-entropy {expected:.7g}")
    broken = [name for name, value in reference.last.items() if not np.isfinite(value).all()]
    if broken:
        return finding(stage, f"{len(broken)} outputs not finite, e.g. '{broken[0]}'")
    if not device:
        return graph, []
    where = f"device ({mode['dtype']}, {mode['storage']}, {mode['layout']})"
    try:
        message = _device_error(path, options, mode, {**feeds, "labels": labels}, workdir)
    except Exception as error:
        return finding(where, f"{type(error).__name__}: {error}")
    return graph, [] if message is None else [Finding(seed, where, message)]


#: fp16, by trainer: (rtol, atol) of an output against the largest magnitude of its reference tensor.
#: Rounding the activations to half moves every element of a gradient by a fraction of the tensor's scale,
#: not of its own value: a small element of a sum that cancels misses fblc verify's elementwise 1e-2
#: (seed 16: 0.0017 on -0.032 in a gradient whose largest element is 1.04), so the fuzzer judges fp16 by
#: the tensor's scale. ES estimates a gradient from member losses that differ by about sigma |g| and divides
#: by sigma: half activations round those losses by as much (seed 68, MemFLoRA ES: the loss 5.6725 for
#: 5.6675, the estimate off by 7 % of its scale), so its tolerance is wider.
FP16_SCALED_TOLERANCE = {"backprop": (1e-2, 1e-3), "es": (1e-1, 1e-3)}


def _device_error(path: str, options: TrainingOptions, mode: Mode, feeds: dict[str, np.ndarray],
                  workdir: str) -> str | None:
    """One step of the graph's bundle on the local OpenCL device in `mode`'s dtype and storage against
    onnxruntime's run of the same step (fblc.tools.verify.verify_model's flow); None when every output agrees
    (fp32: verify's tolerances; fp16: FP16_SCALED_TOLERANCE)."""
    from fblc.codegen.compile import compile_model  # the device stage only: codegen and pyopencl
    from fblc.runtime.local import LocalRunner
    from fblc.tools.verify import compare, reference_graph

    dtype = mode["dtype"]
    with tempfile.TemporaryDirectory(dir=workdir) as scratch:
        options = replace(options, dtype=dtype)
        step, _ = compile_model(path, os.path.join(scratch, "bundle"), "adreno830", dtype, options)
        step_path = os.path.join(scratch, "step.onnx")
        save_model_atomically(reference_graph(step, path, options), step_path)
        reference = ReferenceStep(step_path)
        reference.step(feeds)
        runner = LocalRunner(os.path.join(scratch, "bundle"), storage=mode["storage"])
        runner.step(feeds)
        device = {name: runner.read_before_swap(name) for name in reference.last}
    rows = compare(device, reference.last, "fp32")
    if dtype == "fp16":
        rtol, atol = FP16_SCALED_TOLERANCE[mode["trainer"]]
        rows = [replace(row, ok=row.max_abs <= atol + rtol * float(np.abs(reference.last[row.name]).max(initial=0)))
                if row.name in reference.last else row for row in rows]
    bad = [row for row in rows if not row.ok]
    if not bad:
        return None
    worst = max(bad, key=lambda row: row.max_rel)
    return (f"{len(bad)} of {len(rows)} outputs differ from onnxruntime, worst '{worst.name}' "
            f"(max abs {worst.max_abs:.3g})")


# --- broken files (fblc.tools.mutations) -------------------------------------------------------

def check_mutation(seed: int, workdir: str) -> tuple[str, Finding | None]:
    """(mutation kind, a `crash` finding when loading or building raised anything but an FblcError)."""
    kind, data = mutant(random_graph(seed).model, seed)
    path = os.path.join(workdir, f"mutant_{seed}.onnx")
    with open(path, "wb") as handle:
        handle.write(data)
    try:
        build_training_graph(load_model(path), OPTIONS)
    except FblcError:
        pass
    except Exception as error:
        where = traceback.extract_tb(error.__traceback__)[-1]
        return kind, Finding(seed, f"crash ({kind})", f"{type(error).__name__}: {str(error)[:200]} "
                                                      f"at {os.path.basename(where.filename)}:{where.lineno}")
    return kind, None


# --- the command ---------------------------------------------------------------------------------

@dataclass
class Summary:
    graphs: int = 0
    device_graphs: int = 0
    mutations: int = 0
    ops: Counter[str] | None = None
    #: "name=value" of MODES over all graphs, and over those that also ran on the device
    modes: Counter[str] | None = None
    device_modes: Counter[str] | None = None
    findings: list[Finding] | None = None


def fuzz(graphs: int, seed: int, device_every: int, mutations: int, workdir: str,
         progress: Callable[[str], None] = lambda line: None, device_seeds: Collection[int] | None = None) -> Summary:
    """Check `graphs` random graphs from `seed` on, every `device_every`-th also on the device (or, given
    `device_seeds`, those seeds), then load `mutations` broken files."""
    summary = Summary(ops=Counter(), modes=Counter(), device_modes=Counter(), findings=[])
    assert summary.ops is not None and summary.findings is not None
    assert summary.modes is not None and summary.device_modes is not None
    for index in range(graphs):
        device = (seed + index in device_seeds) if device_seeds is not None else (
            device_every > 0 and index % device_every == 0)
        graph, found = check_graph(seed + index, workdir, device)
        summary.graphs += 1
        summary.device_graphs += int(device)
        summary.ops.update(set(graph.ops))
        drawn = [f"{name}={value}" for name, value in draw_mode(seed + index).items()]
        summary.modes.update(drawn)
        if device:
            summary.device_modes.update(drawn)
        summary.findings += found
        progress(f"graph {index + 1}/{graphs} (seed {seed + index}{', device' if device else ''}): "
                 + ("; ".join(str(f) for f in found) if found else "ok"))
    for index in range(mutations):
        kind, crash = check_mutation(seed + index, workdir)
        summary.mutations += 1
        if crash is not None:
            summary.findings.append(crash)
            progress(str(crash))
    return summary


def _arguments(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m fblc.tools.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("--graphs", type=int, default=300, help="random graphs to check (default: 300)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first graph (default: 0)")
    parser.add_argument("--device-every", type=int, default=20,
                        help="run every Nth graph on the local OpenCL device too, both layouts; 0: never (default: 20)")
    parser.add_argument("--mutations", type=int, default=200, help="broken model files to load (default: 200)")
    parser.add_argument("--keep", metavar="DIR", help="keep the graphs, steps and bundles in DIR")
    return parser.parse_args(argv)


def report(summary: Summary) -> Iterator[str]:
    """The closing lines: the totals, the op types covered, then each finding."""
    assert summary.ops is not None and summary.findings is not None
    yield (f"{summary.graphs} graphs ({summary.device_graphs} also on the device, in their drawn modes), "
           f"{len(summary.ops)} op types, {summary.mutations} broken files: {len(summary.findings)} findings")
    yield "ops: " + ", ".join(f"{op} {count}" for op, count in sorted(summary.ops.items()))
    assert summary.modes is not None and summary.device_modes is not None
    yield "modes (all graphs / on the device): " + ", ".join(
        f"{mode} {count}/{summary.device_modes[mode]}" for mode, count in sorted(summary.modes.items()))
    for found in summary.findings:
        yield f"  {found}"


def main(argv: list[str] | None = None) -> int:
    """1 when the run made any finding (the count itself decides: its printed line is for people)."""
    args = _arguments(argv)
    workdir = args.keep or tempfile.mkdtemp(prefix="fblc-fuzz-")
    os.makedirs(workdir, exist_ok=True)
    summary = fuzz(args.graphs, args.seed, args.device_every, args.mutations, workdir,
                   progress=lambda line: print(line, flush=True))
    print("\n".join(report(summary)))
    assert summary.findings is not None
    return 1 if summary.findings else 0


if __name__ == "__main__":
    sys.exit(main())
