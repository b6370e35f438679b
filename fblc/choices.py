"""The names the command line offers for its choices, as constant tables that import nothing.

`fblc --help`, `fblc COMMAND --help` and every argument error build the whole parser; reading
these names from the modules that implement them (fblc.compiler.losses, ...) imported onnx,
onnx_ir and numpy first: 1.5 s before a usage line. Those modules keep their own tables keyed
by the same names; tests/test_cli_rough_edges.py checks that the two agree.
"""

from __future__ import annotations

IGNORE_INDEX = -100  # fblc.compiler.losses.IGNORE_INDEX

#: --loss: name -> what it computes (fblc.compiler.losses.LOSSES)
LOSSES: dict[str, str] = {
    "cross_entropy": "mean cross-entropy of logits [N, C], [N, T, C] or [N, C, H, W...] against int64 labels "
                     f"(label {IGNORE_INDEX} is ignored)",
    "mse": "mean squared error against float labels of the output's shape",
    "output": "the model's first output is already the loss",
}
OPTIMIZERS = ("sgd", "adam", "adamw")  # fblc.compiler.optimizers.OPTIMIZERS
LOSS_SCALES = ("auto", "dynamic", "none")  # fblc.compiler.loss_scale.LOSS_SCALES

# fblc.compiler.adapters
ADAPTERS = ("none", "lora", "memflora", "memflora-sg", "fura-s")
ADAPTER_SITES = ("auto", "all", "pointwise", "linear")
WIDEST_CHOSEN_BLOCK = 64  # fura-s without --block: the widest power of two tried (fblc.compiler.fura_s)
DEFAULT_RANK = 2

# fblc.compiler.es: the trainers, ES's rewards and the defaults of EsConfig, which reads them here
TRAINERS = ("backprop", "es")
#: --trainer none: a forward bundle, the model's step without loss, backward or optimizer (pass forward_step);
#: no trainer, so not in TRAINERS (the fuzzer's training modes)
FORWARD = "none"
TRAINER_CHOICES = (*TRAINERS, FORWARD)
REWARDS = ("neg-loss", "accuracy", "external")
ES_OPTIMIZERS = ("sgd", "adam")
#: MobileSpec's FuRA-S settings (its Table A2): 15 antithetic pairs per update (Countdown, MATH, LaMP;
#: 25 on INT4 models, 16 on Sudoku), relative perturbation mu_rel = 3e-2 and step alpha = 1 in every ES
#: experiment but per-user LaMP. alpha is fblc's --lr under --es-optimizer sgd (fblc.compiler.es)
ES_PAIRS = 15
ES_SIGMA = 3e-2
ES_SGD_LR = 1.0
ES_REWARD = "neg-loss"
#: the source --help names for the ES defaults
ES_SOURCE = "MobileSpec Table A2"
LR = 1e-2  # fblc.compiler.optimizers.OptimizerConfig's lr: backprop, and ES's adam

STORAGES = ("auto", "image", "buffer")  # fblc.runtime.local.STORAGES
LAYOUT_SEARCHES = ("blocks", "traced", "flat")  # fblc.passes.rtile_select.LAYOUT_SEARCHES
