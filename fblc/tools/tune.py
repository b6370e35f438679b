"""`fblc tune MODEL --target PROFILE --device D -o TUNED.json`: the fastest schedule of each kernel shape, measured.

The model compiles once for the profile; every kernel whose schedule offers choices (plan.json's `choices`) is
grouped by its shape key (codegen/shape_key.py: kernels of one shape share one schedule). Each shape gets at most
`limit` candidates: its default, then the other values of one field at a time, the fields taken in turn (tile
rows x columns within the work-item's accumulators, group_size on a spread of powers of two, accumulator_form,
pair_stride). Round r compiles one bundle in which every shape takes its r-th candidate, through the same
profile `schedules` entries by shape key that the tuned profile will hold, and measures it (runtime/tune.py:
launch times; each changed kernel's outputs against the reference's, in isolation on a local device). A
candidate the compiler or the device refuses, or whose outputs differ beyond reassociation, is dropped with the
reason. Each shape keeps its fastest candidate where it beats the default by more than NOISE; the profile
written is the target's with those entries (source "measured: fblc tune DATE DEVICE") in its `schedules`, so
every later compile for it uses them (the profile's digest, which the bundle records, changes with them).
Finally the model compiles for the tuned profile: its plan must record each tuned value, and the step is timed
against the default's.
"""

from __future__ import annotations

import copy
import json
import os
import re
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

from fblc.codegen.compile import compile_model
from fblc.codegen.plan import kernel_groups
from fblc.codegen.schedule import OVERRIDABLE, is_shape_key
from fblc.codegen.shape_key import SUFFIXES, describe
from fblc.compiler.reference import random_feeds
from fblc.bundle_format import BundleError
from fblc.errors import FblcError
from fblc.paths import write_atomically
from fblc.passes.pipeline import TrainingOptions
from fblc.profiles import load_profile
from fblc.profiles.profile import PRIVATE_FLOATS
from fblc.runtime.tune import Measurement

#: a candidate must be this much faster than the default to replace it, and by MIN_GAIN_MS at least (timing
#: noise of repeated runs; a device's event timer ticks in microseconds)
NOISE = 0.03
MIN_GAIN_MS = 0.001
#: candidates per kernel shape, its default included (fblc tune --candidates)
CANDIDATES = 6
#: group sizes tried: the powers of GROUP_STEP among a kernel's choices (1, 4, 16, 64, 256: the powers of two
#: between them move a time by less than the noise while doubling the rounds)
GROUP_STEP = 4
KERNEL_IN_ERROR = re.compile(r"kernel (?:shape '[^']*' \()?'(k\d+_[A-Za-z0-9_]+)'")
Say = Callable[[str], None]


class Bench(Protocol):
    device_name: str

    def reference(self, bundle: str, watched: Any) -> Measurement: ...
    def measure(self, bundle: str, changed: Any) -> Measurement: ...


@dataclass(eq=False)  # hashed by identity
class KernelShape:
    key: str
    description: str
    kernels: list[str]
    choices: dict[str, list[Any]]
    default: dict[str, Any]  # its fields as the compiler decided them
    candidates: list[dict[str, Any]] = field(default_factory=list)  # fields to set; [0] = {} (the default)
    ms: list[float | None] = field(default_factory=list)  # per candidate: its kernels' time, None: not measured
    dropped: dict[int, str] = field(default_factory=dict)  # candidate -> why

    @property
    def best(self) -> int:
        measured = [(ms, i) for i, ms in enumerate(self.ms) if ms is not None and i not in self.dropped]
        fastest = min(measured) if measured else (None, 0)
        default = self.ms[0] if self.ms else None
        gain = default - fastest[0] if default is not None and fastest[0] is not None else 0.0
        return fastest[1] if gain > max(NOISE * default, MIN_GAIN_MS) else 0


@dataclass
class TuneResult:
    shapes: list[KernelShape]
    device: str
    profile: dict[str, Any]
    default_ms: dict[str, float]  # each tunable launch's time in the default bundle
    tuned_ms: dict[str, float]  # in the bundle compiled for the tuned profile
    seconds: float

    @property
    def step_ms(self) -> tuple[float, float]:
        """The tunable launches' time per step: default bundle, tuned bundle."""
        return sum(self.default_ms.values()), sum(self.tuned_ms.values())

    @property
    def tuned_kernels(self) -> list[str]:
        return [name for shape in self.shapes if shape.best for name in shape.kernels]


def tunable_shapes(plan: dict[str, Any], pattern: str | None, described: dict[str, str]) -> list[KernelShape]:
    """The plan's kernels with schedule choices (matching `pattern` by kernel name or shape key), by shape;
    `described`: kernel name -> what it computes (shape_key.describe)."""
    found: dict[str, KernelShape] = {}
    matcher = re.compile(pattern) if pattern else None
    for launch in plan["kernels"]:
        schedule = launch["schedule"]
        choices = {k: v for k, v in schedule.get("choices", {}).items() if len(v) > 1}
        key = schedule.get("shape_key", "")
        if not choices or not key or (matcher and not (matcher.search(launch["name"]) or matcher.search(key))):
            continue
        if key not in found:
            default = {k: schedule[k] for k in OVERRIDABLE if k in schedule}
            found[key] = KernelShape(key, described.get(launch["name"], key), [], choices, default)
        found[key].kernels.append(launch["name"])
    return list(found.values())


def candidates(shape: KernelShape, limit: int) -> list[dict[str, Any]]:
    """The default ({}) and up to limit - 1 one-field variations, the fields in turn (see the module docstring)."""
    choices, default = shape.choices, shape.default
    per_field: list[list[dict[str, Any]]] = []
    rows, columns = choices.get("tile_rows", [default.get("tile_rows")]), choices.get("tile_columns",
                                                                                      [default.get("tile_columns")])
    if "tile_rows" in choices or "tile_columns" in choices:
        tiles = [(r, c) for r in rows for c in columns if 4 * r * c <= PRIVATE_FLOATS
                 and (r, c) != (default.get("tile_rows"), default.get("tile_columns"))]
        tiles.sort(key=lambda t: abs(t[0] * t[1] - default["tile_rows"] * default["tile_columns"]))
        per_field.append([{"tile_rows": r, "tile_columns": c} for r, c in tiles])
    if "group_size" in choices:
        spread = [g for g in choices["group_size"] if g in {GROUP_STEP ** k for k in range(8)}]
        per_field.append([{"group_size": g} for g in spread if g != default.get("group_size")])
    for name in ("accumulator_form", "pair_stride"):
        if name in choices:
            per_field.append([{name: v} for v in choices[name] if v != default.get(name)
                              and not (name == "pair_stride" and not default.get("accumulator_form"))])
    chosen: list[dict[str, Any]] = [{}]
    while len(chosen) < limit and any(per_field):
        for options in per_field:
            if options and len(chosen) < limit:
                chosen.append(options.pop(0))
    return chosen


def tune(model: str, options: TrainingOptions, target: str, dtype: str, make_bench: Callable[[Any], Bench],
         output: str, budget_s: float, pattern: str | None = None, limit: int = CANDIDATES, say: Say = print,
         dump_dir: str | None = None) -> TuneResult:
    """Tune `model`'s kernel shapes for `target` on the bench `make_bench(feeds)` gives (feeds: a random batch
    of the step's inputs) and write the tuned profile to `output` (see the module docstring); `dump_dir`: the
    default compile's pass dumps."""
    started = time.perf_counter()
    base = copy.deepcopy(load_profile(target).raw)
    with tempfile.TemporaryDirectory(prefix="fblc-tune-") as scratch:
        compiler = _Compiler(model, options, dtype, base, scratch)
        step, plan = compiler.compile({}, "default", dump_dir=dump_dir)
        shapes = tunable_shapes(plan, pattern, descriptions(step))
        if not shapes:
            raise FblcError(f"no kernel of '{model}' {'matching ' + repr(pattern) + ' ' if pattern else ''}has a "
                            "schedule with choices to tune", "tune a model with MatMul, Gemm, Conv, ConvTranspose or "
                            "reduction kernels, or widen --kernels")
        for shape in shapes:
            shape.candidates = candidates(shape, limit)
            shape.ms = [None] * len(shape.candidates)
        watched = {name for shape in shapes for name in shape.kernels}
        bench = make_bench(random_feeds(step))
        say(f"tuning {len(shapes)} kernel shapes ({len(watched)} launches) of {model} for {base['name']}: "
            f"{max(len(s.candidates) for s in shapes)} rounds at most")
        default = bench.reference(compiler.bundle("default"), watched)
        say(f"measuring on {bench.device_name}")
        rounds = max(len(s.candidates) for s in shapes)
        for index in range(1, rounds):
            for shape in shapes:
                shape.ms[0] = sum(default.times[k] for k in shape.kernels)
            if time.perf_counter() - started > budget_s:
                say(f"stopped before round {index + 1} of {rounds}: the --budget-s of {budget_s:g} s is spent")
                break
            trying = [s for s in shapes if index < len(s.candidates)]
            _round(compiler, bench, trying, index)
            # the default timed again after each round, each kernel keeping its fastest: a candidate must beat the
            # default at its best, whatever the load of the machine when either ran
            default = Measurement(_fastest(default, bench.measure(compiler.bundle("default"), ()), watched))
            dropped = sum(index in s.dropped for s in trying)
            say(f"round {index + 1}/{rounds}: {len(trying)} kernel shapes, {len(trying) - dropped} measured, "
                f"{dropped} dropped ({time.perf_counter() - started:.1f} s)")
        for shape in shapes:
            shape.ms[0] = sum(default.times[k] for k in shape.kernels)
        for shape in shapes:
            say(_outcome_line(shape))
        profile = tuned_profile(base, shapes, bench.device_name)
        _, tuned_plan = compiler.compile({s.key: s.candidates[s.best] for s in shapes if s.best}, "tuned",
                                         profile=profile)
        _check_applied(tuned_plan, shapes)
        final = bench.measure(compiler.bundle("tuned"), watched)
        if final.rejected or final.whole:
            raise FblcError(f"the tuned bundle's kernels differ from the default's: {final.whole or final.rejected}",
                            "report this: every tuned schedule passed the same check alone")
        # default and tuned bundles timed once more, back to back: the load of a shared machine changes over a run
        before = _fastest(default, bench.measure(compiler.bundle("default"), ()), watched)
        after = _fastest(final, bench.measure(compiler.bundle("tuned"), ()), watched)
    write_atomically(output, lambda out: out.write((json.dumps(profile, indent=1) + "\n").encode()))
    return TuneResult(shapes, bench.device_name, profile, before, after, time.perf_counter() - started)


def _fastest(first: Measurement, second: Measurement, kernels: set[str]) -> dict[str, float]:
    return {k: min(first.times[k], second.times[k]) for k in sorted(kernels)}


class _Compiler:
    """Compiles the model into scratch bundles for a profile with given shape-keyed schedule entries."""

    def __init__(self, model: str, options: TrainingOptions, dtype: str, base: dict[str, Any], scratch: str) -> None:
        self.model, self.options, self.dtype, self.base, self.scratch = model, options, dtype, base, scratch

    def bundle(self, label: str) -> str:
        return os.path.join(self.scratch, label)

    def compile(self, entries: dict[str, dict[str, Any]], label: str, profile: dict[str, Any] | None = None,
                dump_dir: str | None = None) -> tuple[Any, dict[str, Any]]:
        if profile is None:
            profile = copy.deepcopy(self.base)
            kept = {k: v for k, v in profile.get("schedules", {}).items() if not is_shape_key(k)}
            profile["schedules"] = {**kept, **{key: {**fields, "source": "estimated: an fblc tune candidate"}
                                               for key, fields in entries.items()}}
        path = os.path.join(self.scratch, f"{label}.json")
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(profile, handle)
        # each kernel its own launch: a GPU profile's co-launch would pair kernels by their schedules (a candidate's
        # group size changes the pairs) and time and check two kernels as one; later compiles pair the tuned ones
        step, _ = compile_model(self.model, self.bundle(label), path, self.dtype, self.options,
                                dump_dir=dump_dir, co_launched_kernels=False)
        with open(os.path.join(self.bundle(label), "plan.json"), encoding="utf-8") as handle:
            return step, json.load(handle)


def _round(compiler: _Compiler, bench: Bench, shapes: list[KernelShape], index: int) -> None:
    """Compile and measure round `index` (each shape's index-th candidate); drop what fails, retry the rest."""
    live = list(shapes)
    while live:
        entries = {s.key: s.candidates[index] for s in live}
        owner = {name: s for s in live for name in s.kernels}
        try:
            _, plan = compiler.compile(entries, f"round{index}")
            ignored = _not_taken(plan, live, index)
            if ignored:  # measuring them would time the default again
                live = [s for s in live if s not in ignored]
                owner = {name: s for s in live for name in s.kernels}
            if not live:
                return
            measured = bench.measure(compiler.bundle(f"round{index}"), set(owner))
        except (FblcError, BundleError) as error:  # the compiler or the device refused a candidate: drop it, retry
            text = error.one_line() if isinstance(error, FblcError) else str(error).splitlines()[0]
            blamed = {owner[m] for m in KERNEL_IN_ERROR.findall(text) if m in owner} or set(live)
            for shape in blamed:
                shape.dropped[index] = text
            live = [s for s in live if s not in blamed]
            continue
        if measured.whole and len(live) > 1:  # no kernel named: try the shapes one by one
            for shape in live:
                _round(compiler, bench, [shape], index)
            return
        for shape in live:
            problems = [measured.rejected[k] for k in shape.kernels if k in measured.rejected]
            if problems or measured.whole:
                shape.dropped[index] = f"outputs differ from the default's: {(problems or [measured.whole])[0]}"
            shape.ms[index] = sum(measured.times[k] for k in shape.kernels)
        return


def descriptions(step: Any) -> dict[str, str]:
    """Kernel name -> "Gemm [8,32] [64,32] -> [8,64]" for every kernel group of the fused step."""
    found = {}
    for group in kernel_groups(step.graph):
        for suffix in ("", *SUFFIXES):
            found[group.name + suffix] = describe(group, group.name + suffix)
    return found


def _not_taken(plan: dict[str, Any], shapes: list[KernelShape], index: int) -> set[KernelShape]:
    """The shapes whose kernels compiled without their index-th candidate's values (a choice the kernel's
    emitter does not follow there), each dropped with the reason."""
    schedules = {launch["name"]: launch["schedule"] for launch in plan["kernels"]}
    found = set()
    for shape in shapes:
        for name in shape.kernels:
            lost = {k: schedules[name].get(k) for k, v in shape.candidates[index].items()
                    if schedules[name].get(k) != v}
            if lost:
                shape.dropped[index] = f"kernel '{name}' compiled with {_fields(lost)} instead: it does not take it"
                found.add(shape)
                break
    return found


def _fields(fields: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in fields.items()) or "default"


def _outcome_line(shape: KernelShape) -> str:
    tried = ", ".join(f"{_fields(c)} {'-' if ms is None else f'{ms:.3f}'}{' (dropped)' if i in shape.dropped else ''}"
                      for i, (c, ms) in enumerate(zip(shape.candidates, shape.ms)))
    best, default = shape.best, shape.ms[0] or 0.0
    result = (f"keeps {_fields(shape.candidates[best])}: {default:.3f} -> {shape.ms[best]:.3f} ms "
              f"({default / max(shape.ms[best] or default, 1e-9):.2f}x)" if best else "keeps the default")
    reasons = "".join(f"\n  dropped {_fields(shape.candidates[i])}: {why}" for i, why in sorted(shape.dropped.items()))
    return f"{shape.description} x{len(shape.kernels)} [{shape.key}]: {result}; tried (ms) {tried}{reasons}"


def tuned_profile(base: dict[str, Any], shapes: list[KernelShape], device: str) -> dict[str, Any]:
    """The base profile with each tuned shape's entry in `schedules` (a shape that kept its default has none)."""
    profile = copy.deepcopy(base)
    entries = dict(profile.get("schedules", {}))
    source = f"measured: fblc tune {time.strftime('%Y-%m-%d', time.gmtime())} on {device}"
    for shape in shapes:
        entries.pop(shape.key, None)
        if shape.best:
            entries[shape.key] = {**shape.candidates[shape.best], "source": source, "shape": shape.description,
                                  "measured_ms": {"default": round(shape.ms[0] or 0.0, 5),
                                                  "tuned": round(shape.ms[shape.best] or 0.0, 5)}}
    profile["schedules"] = entries
    return profile


def _check_applied(plan: dict[str, Any], shapes: list[KernelShape]) -> None:
    """Every tuned kernel's schedule in the tuned profile's plan holds its tuned fields."""
    schedules = {launch["name"]: launch["schedule"] for launch in plan["kernels"]}
    for shape in shapes:
        for name in shape.kernels:
            for key, value in shape.candidates[shape.best].items():
                if schedules[name].get(key) != value:
                    raise FblcError(f"kernel '{name}' compiled for the tuned profile has {key} "
                                    f"{schedules[name].get(key)!r}, not the tuned {value!r}", "report this")

