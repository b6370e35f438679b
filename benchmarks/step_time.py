"""Median training-step time: fblc's OpenCL bundle on the local device vs a PyTorch eager step, same model and batch.

    python benchmarks/step_time.py [--steps 5] [--models benchmarks|unseen|zoo|all|mlp,resnet4,bert,...]
        [--storages image,buffer] [--threads N] [--statistic median|min] [--clock wall|cpu]
        [--base-tree DIR]

Both sides run forward, cross-entropy loss, backward and AdamW on this CPU: fblc through its
kernels on PoCL (the local OpenCL device), PyTorch eagerly with its own threads. The table
gives the median (`--statistic min`: the least) of `--steps` steps after one warm-up step, and fblc's
time over PyTorch's. The sides take their steps in turn, round by round (interleaved_ms), so each ratio compares the same
minutes of a shared machine, whose speed drifts.
A benchmark, not a test: no threshold. fblc's kernels read image2d textures, which PoCL serves
through a library call per texel read that also keeps its compiler from vectorising a kernel across
work-items; PyTorch runs oneDNN's vectorised convolutions and GEMMs on the same cores. So the same
bundle runs twice: with image2d_t textures, as on a phone, and with LocalRunner's storage "buffer"
(the same kernels, each texture's texels in index order in a __global buffer), the form a CPU's
OpenCL runs fast.

`--models unseen` (or `zoo`) adds architectures that are in no other benchmark and that no schedule was tuned for
(UNSEEN: transformers configs with random weights, exported by torch.onnx.export as tests/support/zoo.py
does; nothing is downloaded): four convolutional nets (a four-stage ResNet, a ConvNeXt, an EfficientNet, a MobileViT) and three
transformers (BERT and DistilBERT encoders, a GPT-2 decoder) plus a ViT and a Swin. `--base-tree DIR` (a checkout of another revision, e.g. a
`git worktree`) compiles each model there as well and times its bundle beside this tree's in the same rounds
(both run by this tree's LocalRunner): the before -> after of a kernel change, interleaved.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Sequence

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fblc.codegen.compile import compile_model  # noqa: E402
from fblc.compiler.optimizers import OptimizerConfig  # noqa: E402
from fblc.passes.pipeline import TrainingOptions  # noqa: E402
from fblc.runtime.local import LocalRunner  # noqa: E402
from tests.support import models  # noqa: E402

Case = tuple[str, torch.nn.Module, dict[str, np.ndarray], np.ndarray, Callable[[torch.nn.Module], torch.Tensor]]


def _classification(name: str, path: str, module: torch.nn.Module, x: np.ndarray, classes: int,
                    input_name: str = "x") -> Case:
    labels = np.random.default_rng(1).integers(0, classes, x.shape[0]).astype(np.int64)
    tensor, target = torch.from_numpy(x), torch.from_numpy(labels)
    return (name, module, {input_name: x, "path": path}, labels,
            lambda m: torch.nn.functional.cross_entropy(m(tensor), target))


#: the script's own models (the default set, `--models benchmarks`)
BENCHMARKS = ("mlp", "tresnet", "mobilenet_v2", "resnet", "llama")

#: architectures in no other benchmark (`--models unseen`): name -> row label, transformers model class, its
#: config (random weights under torch.manual_seed(0); hidden sizes a phone app might train), input and batch.
#: The ResNet is the issue's "model in no benchmark" (four stages, batch 4, 64 x 64).
UNSEEN: dict[str, tuple[str, str, dict, str, tuple[int, ...]]] = {
    "resnet4": ("resnet 4 stages [4,3,64,64]", "ResNetForImageClassification",
                dict(embedding_size=32, hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], layer_type="basic",
                     num_labels=10), "pixel_values", (4, 3, 64, 64)),
    "convnext": ("convnext 4 stages [4,3,64,64]", "ConvNextForImageClassification",
                 dict(hidden_sizes=[32, 64, 128, 256], depths=[1, 1, 1, 1], num_labels=10), "pixel_values",
                 (4, 3, 64, 64)),
    "bert": ("bert 2L h128 [4,64]", "BertForSequenceClassification",
             dict(vocab_size=512, hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512,
                  max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                  num_labels=10), "input_ids", (4, 64)),
    "gpt2": ("gpt2 2L h128 [4,64]", "GPT2LMHeadModel",
             dict(vocab_size=512, n_embd=128, n_layer=2, n_head=4, n_positions=64, bos_token_id=1, eos_token_id=2,
                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0), "input_ids", (4, 64)),
    "vit": ("vit 2L h128 [4,3,64,64]", "ViTForImageClassification",
            dict(image_size=64, patch_size=8, hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=512, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=10),
            "pixel_values", (4, 3, 64, 64)),
    "distilbert": ("distilbert 2L h128 [4,64]", "DistilBertForSequenceClassification",
                   dict(vocab_size=512, dim=128, n_layers=2, n_heads=4, hidden_dim=512, max_position_embeddings=64,
                        dropout=0.0, attention_dropout=0.0, seq_classif_dropout=0.0, num_labels=10), "input_ids",
                   (4, 64)),
    "mobilevit": ("mobilevit xxs [4,3,64,64]", "MobileViTForImageClassification",  # apple/mobilevit-xx-small's sizes
                  dict(image_size=64, patch_size=2, hidden_sizes=[64, 80, 96], neck_hidden_sizes=[16, 16, 24, 48, 64,
                       80, 320], num_attention_heads=4, expand_ratio=2.0, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0, classifier_dropout_prob=0.0, num_labels=10), "pixel_values",
                  (4, 3, 64, 64)),
    "efficientnet": ("efficientnet b0 x0.5 [4,3,64,64]", "EfficientNetForImageClassification",
                     dict(image_size=64, width_coefficient=0.5, depth_coefficient=0.5, hidden_dim=640, dropout_rate=0.0,
                          drop_connect_rate=0.0, num_labels=10), "pixel_values", (4, 3, 64, 64)),
    "swin": ("swin 2 stages e48 [4,3,64,64]", "SwinForImageClassification",
             dict(image_size=64, patch_size=4, embed_dim=48, depths=[2, 2], num_heads=[3, 6], window_size=4,
                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=10),
             "pixel_values", (4, 3, 64, 64)),
}
#: models the dynamo exporter cannot take (Swin's window partition: a view of non-contiguous strides): the exporter
#: and constant folding tests/support/zoo.py gives them (folding would consume the relative position bias table)
LEGACY_EXPORT = {"swin": ("legacy", False)}
#: `zoo` is `unseen` by another name (the zoo's families at sizes a phone would train)
GROUPS = {"benchmarks": BENCHMARKS, "unseen": tuple(UNSEEN), "zoo": tuple(UNSEEN), "all": BENCHMARKS + tuple(UNSEEN)}


def model_names(spec: str) -> list[str]:
    """`--models`: names and group names (GROUPS), comma-separated, in order, each once."""
    names: list[str] = []
    for item in spec.split(","):
        for name in GROUPS.get(item, (item,)):
            if name not in BENCHMARKS + tuple(UNSEEN):
                raise SystemExit(f"--models: no model '{name}'; choose from {', '.join(GROUPS)}, "
                                 f"{', '.join(BENCHMARKS + tuple(UNSEEN))}")
            if name not in names:
                names.append(name)
    return names


def unseen_case(name: str, directory: str) -> Case:
    """UNSEEN[name] built, exported (dynamo, no optimizer: BatchNorm stays) and paired with its torch loss."""
    import transformers

    from tests.support import zoo

    label, model_class, config, input_name, shape = UNSEEN[name]
    torch.manual_seed(0)
    config_class = model_class.replace("ForImageClassification", "").replace("ForSequenceClassification", "")
    config_class = {"GPT2LMHeadModel": "GPT2"}.get(config_class, config_class) + "Config"
    module = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
    fixed = {"use_cache": False} if "LMHead" in model_class else {}
    module = zoo.logits_of(zoo.randomize_constant_parameters(module, seed=1), (input_name,), **fixed).eval()
    rng = np.random.default_rng(0)
    x = (rng.integers(3, config["vocab_size"], shape).astype(np.int64) if input_name == "input_ids"
         else rng.standard_normal(shape).astype(np.float32))
    inputs = {input_name: x}
    with torch.no_grad():
        logits = module(torch.from_numpy(x))
    if logits.dim() == 3:  # a causal LM: the next token at every position but the last
        labels = np.full_like(x, models.IGNORE_INDEX)
        labels[:, :-1] = x[:, 1:]
    else:
        labels = rng.integers(0, logits.shape[-1], shape[0]).astype(np.int64)
    path = os.path.join(directory, f"{name}.onnx")
    exporter, fold = LEGACY_EXPORT.get(name, ("dynamo", True))
    zoo.export(module, inputs, exporter, path, fold)
    return label, module, {**inputs, "path": path}, labels, zoo.cross_entropy_loss(inputs, labels)


def build_cases(directory: str, names: list[str]) -> list[Case]:
    rng = np.random.default_rng(0)
    cases = []
    if "mlp" in names:
        path = models._example("mlp")(os.path.join(directory, "mlp.onnx"), batch=64, in_features=256,
                                      hidden=(512, 512), classes=10)
        cases.append(_classification("mlp B=64", path, models.TorchMLP.from_onnx(path),
                                     rng.standard_normal((64, 256)).astype(np.float32), 10))
    if "tresnet" in names:
        path = models._example("tresnet")(os.path.join(directory, "tresnet.onnx"), batch=64)
        cases.append(_classification("t-resnet B=64", path, models.TorchTResNet.from_onnx(path),
                                     rng.standard_normal((64, 97, 60, 1)).astype(np.float32), 17))
    if "mobilenet_v2" in names:
        x = rng.standard_normal((8, 3, 97, 60)).astype(np.float32)
        path = os.path.join(directory, "mobilenet_v2.onnx")
        module = models.export_mobilenet_v2(path, x, num_labels=17, image_size=97)
        cases.append(_classification("mobilenetv2 [8,3,97,60]", path, module, x, 17, "pixel_values"))
    if "resnet" in names:  # a MaxPool stem (7x7 conv, 3x3 pool): its backward was quadratic until the gather form
        import transformers

        torch.manual_seed(0)
        module = models.logits_only(transformers.ResNetForImageClassification(transformers.ResNetConfig(
            num_labels=10, embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1])), "pixel_values").eval()
        x = rng.standard_normal((4, 3, 64, 64)).astype(np.float32)
        path = os.path.join(directory, "resnet.onnx")
        models._quiet_dynamo_export(module, (torch.from_numpy(x),)).save(path)
        cases.append(_classification("resnet stem [4,3,64,64]", path, module, x, 10, "pixel_values"))
    if "llama" in names:
        exported, _ = models.llama(directory)
        ids = exported.inputs["input_ids"]
        cases.append(("llama 2L B=2 T=16", exported.module, {"input_ids": ids, "path": exported.path},
                      exported.labels, exported.loss_of))
    cases += [unseen_case(name, directory) for name in names if name in UNSEEN]
    return cases


def torch_stepper(module: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor]) -> Callable[[], None]:
    """One PyTorch eager training step of `module` (AdamW) per call."""
    optimizer = torch.optim.AdamW(module.parameters(), lr=1e-3, weight_decay=1e-2)

    def step() -> None:
        optimizer.zero_grad()
        loss_of(module).backward()
        optimizer.step()
    return step


def interleaved_ms(steppers: dict[str, Callable[[], object]], steps: int, settle: bool = True,
                   statistic: Callable[[list[float]], float] = statistics.median,
                   clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """The median (`statistic`) ms of each of `steppers` over `steps` rounds, after a warm-up call of each (the OpenCL
    JIT, PyTorch's first allocations). Each round gives every stepper its turn, so a drift in a shared
    machine's speed reaches every side alike (this one's moved 30 % between runs). With `settle` a turn
    is two calls and times the second: the previous side's worker threads still spin a while after it
    returns (PyTorch's OpenMP pool; only needed where the sides use different thread pools)."""
    for step in steppers.values():
        step()
    times: dict[str, list[float]] = {name: [] for name in steppers}
    for _ in range(steps):
        for name, step in steppers.items():
            if settle:
                step()
            started = clock()
            step()
            times[name].append((clock() - started) * 1e3)
    return {name: statistic(values) for name, values in times.items()}


def torch_step_ms(module: torch.nn.Module, loss_of: Callable[[torch.nn.Module], torch.Tensor], steps: int) -> float:
    return interleaved_ms({"torch": torch_stepper(module, loss_of)}, steps)["torch"]


def compile_bundle(path: str, bundle: str, layout: str = "rtile", target: str = "local") -> dict:
    """Compile `path`'s AdamW training step into `bundle`; its report."""
    _, report = compile_model(path, bundle, target, "fp32", TrainingOptions(
        loss="cross_entropy", optimizer=OptimizerConfig("adamw", lr=1e-3, weight_decay=1e-2), layout=layout))
    return report


def runner_stepper(runner: LocalRunner, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    return lambda: runner.step(feeds)


def fblc_step_ms(path: str, feeds: dict[str, np.ndarray], bundle: str, steps: int, layout: str = "rtile",
                 target: str = "local", storages: Sequence[str] = ("image",)) -> tuple[list[float], dict]:
    """Compile `path` (AdamW) into `bundle`, then run it in each of `storages` (LocalRunner's) on the local
    device, their steps interleaved; the median steps in ms and the report."""
    report = compile_bundle(path, bundle, layout, target)
    medians = interleaved_ms({storage: runner_stepper(LocalRunner(bundle, storage=storage), feeds)
                              for storage in storages}, steps)
    return [medians[storage] for storage in storages], report


def compile_elsewhere(tree: str, path: str, bundle: str, target: str) -> None:
    """compile_bundle run by the fblc of checkout `tree` (another revision), in its own process."""
    code = ("import sys; from fblc.codegen.compile import compile_model; "
            "from fblc.compiler.optimizers import OptimizerConfig; from fblc.passes.pipeline import TrainingOptions; "
            "compile_model(sys.argv[1], sys.argv[2], sys.argv[3], 'fp32', TrainingOptions(loss='cross_entropy', "
            "optimizer=OptimizerConfig('adamw', lr=1e-3, weight_decay=1e-2), layout='rtile'))")
    done = subprocess.run([sys.executable, "-c", code, path, bundle, target], cwd=tree, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": tree})
    if done.returncode != 0:
        raise SystemExit(f"compiling {path} in {tree} failed:\n{done.stderr[-3000:]}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--models", default="benchmarks", help="comma-separated model names or groups: "
                        f"{', '.join(f'{g} ({len(n)})' for g, n in GROUPS.items())}; models: "
                        f"{', '.join(BENCHMARKS + tuple(UNSEEN))}")
    parser.add_argument("--storages", default="image,buffer", help="LocalRunner storages to time (image, buffer)")
    parser.add_argument("--base-tree", help="a checkout of another revision: its bundles are timed too ('before')")
    parser.add_argument("--target", default="local", help="the profile the bundles are compiled for (default: local; "
                        "benchmarks/gpu_check.sh runs a phone target's kernels on a GPU)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads of each side: PyTorch's "
                        "and PoCL's (POCL_MAX_PTHREAD_COUNT); 1 keeps a shared machine's load from stalling "
                        "PyTorch's spinning OpenMP workers (default: the CPU count)")
    parser.add_argument("--statistic", choices=("median", "min"), default="median", help="of each side's steps: "
                        "min is the least disturbed by other work on a shared machine")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: the process's CPU time "
                        "(all its threads: PoCL's and PyTorch's workers), which a loaded machine's waits do not inflate")
    args = parser.parse_args()
    os.environ["POCL_MAX_PTHREAD_COUNT"] = str(args.threads)  # read when PoCL's device starts: before any runner
    storages = args.storages.split(",")
    sides = ([("before", args.base_tree)] if args.base_tree else []) + [("", None)]
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        for name, module, inputs, labels, loss_of in build_cases(directory, model_names(args.models)):
            path = inputs.pop("path")
            feeds = {**inputs, "labels": labels}
            steppers: dict[str, Callable[[], object]] = {}
            kernels = {}
            for side, tree in sides:
                bundle = os.path.join(directory, f"{os.path.basename(path)}.{side or 'this'}.bundle")
                if tree:
                    compile_elsewhere(tree, path, bundle, args.target)
                else:
                    compile_bundle(path, bundle, target=args.target)
                with open(os.path.join(bundle, "plan.json")) as plan:
                    kernels[side] = len(json.load(plan)["kernels"])  # launches per step
                steppers.update({(side, storage): runner_stepper(LocalRunner(bundle, storage=storage), feeds)
                                 for storage in storages})
            ms = interleaved_ms({**steppers, "torch": torch_stepper(module.train(False), loss_of)}, args.steps,
                                statistic=min if args.statistic == "min" else statistics.median,
                                clock=time.process_time if args.clock == "cpu" else time.perf_counter)
            for side, _ in sides:
                label = f"{name} {side}".strip()
                rows.append((label, [ms[(side, storage)] for storage in storages], ms["torch"], kernels[side]))
            print(f"  measured {name}", file=sys.stderr)
    fblc_heads = [f"fblc {storage} ms" for storage in storages]
    ratio_heads = [f"{storage} / torch" for storage in storages]
    print(f"{'model':<34} " + " ".join(f"{h:>15}" for h in fblc_heads) + f" {'PyTorch ms':>11} "
          + " ".join(f"{h:>15}" for h in ratio_heads) + f" {'kernels':>8}")
    for label, fblc_ms, torch_ms, kernels in rows:
        print(f"{label:<34} " + " ".join(f"{v:15.1f}" for v in fblc_ms) + f" {torch_ms:11.1f} "
              + " ".join(f"{v / torch_ms:15.2f}" for v in fblc_ms) + f" {kernels:8d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
