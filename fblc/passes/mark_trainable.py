"""mark_trainable: choose the trainable parameters and make them inputs of the step graph.

Rewrite: among initializers tagged `param` by classify_initializers, those matching
`--train` (all, when not given) and not matching `--freeze` keep role `param` and become
graph inputs (after the model's inputs), with their current value kept as the initializer
of the same name; every other initializer gets role `frozen`. A pattern matches a tensor
when it matches its ONNX name or the torch name the export recorded (`fc1.weight` for the
legacy exporter's `onnx::MatMul_12`, fblc.compiler.torch_names). Preconditions:
classify_initializers ran. In place. Errors: a pattern that matches no parameter, or nothing
left to train.
"""

from __future__ import annotations

import re

import onnx_ir as ir

from fblc.compiler import keys
from fblc.errors import TrainableSetError
from fblc.compiler.keys import Role
from fblc.compiler.torch_names import display_name, names_of
from fblc.passes.contracts import ContractPass


def _compile(pattern: str | None, flag: str) -> re.Pattern[str] | None:
    if pattern is None:
        return None
    try:
        return re.compile(pattern)
    except re.error as error:
        raise TrainableSetError(f"{flag} '{pattern}' is not a valid regular expression ({error})",
                                "use Python regex syntax, e.g. 'classifier|layer\\.3'") from None


def _matches(pattern: re.Pattern[str], value: ir.Value) -> bool:
    return any(pattern.search(name) for name in names_of(value))


class MarkTrainable(ContractPass):
    """Apply --train/--freeze and expose the trainable parameters as graph inputs (in place)."""

    name = "mark_trainable"
    ensures_facts = ("trainable inputs",)

    def __init__(self, train: str | None = None, freeze: str | None = None) -> None:
        super().__init__()
        self.train = _compile(train, "--train")
        self.freeze = _compile(freeze, "--freeze")
        self.train_text, self.freeze_text = train, freeze

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        graph = model.graph
        candidates = [v for v in graph.initializers.values() if keys.get_role(v) == Role.PARAM.value]
        for pattern, text, flag in ((self.train, self.train_text, "--train"), (self.freeze, self.freeze_text, "--freeze")):
            if pattern is not None and not any(_matches(pattern, v) for v in candidates):
                examples = ", ".join(display_name(v) for v in candidates[:5]) or "(none)"
                raise TrainableSetError(f"{flag} '{text}' matches no parameter",
                                        f"parameter names look like: {examples}")
        chosen = [v for v in candidates
                  if (self.train is None or _matches(self.train, v))
                  and not (self.freeze is not None and _matches(self.freeze, v))]
        if not chosen:
            raise TrainableSetError("nothing to train: no float parameter is left after --train/--freeze",
                                    "loosen --freeze or --train, or check that the model has float initializers")
        patterns = [f"{flag} '{text}'" for flag, text in (("--train", self.train_text), ("--freeze", self.freeze_text))
                    if text is not None]
        if patterns:  # the summaries name what chose the trained set (fblc.compiler.summary.trained_set_source)
            graph.metadata_props[keys.TRAINED_PATTERNS] = " and ".join(patterns)
        chosen_ids = {id(v) for v in chosen}
        modified = False
        for value in graph.initializers.values():
            if keys.get_role(value) not in (Role.PARAM.value, Role.FROZEN.value):
                continue  # state of earlier passes keeps its role
            role = Role.PARAM if id(value) in chosen_ids else Role.FROZEN
            if keys.get_role(value) != role.value:
                keys.set_role(value, role)
                modified = True
        for value in graph.inputs:
            if keys.get_role(value) is None:
                keys.set_role(value, Role.INPUT)
        already_inputs = {id(v) for v in graph.inputs}
        for value in chosen:
            if id(value) not in already_inputs:
                graph.inputs.append(value)
                modified = True
        return ir.passes.PassResult(model, modified)
