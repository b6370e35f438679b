"""es_gradients: the ES estimate of every parameter's gradient from 2P perturbed forwards (no backward).

Selected by `--trainer es`; it takes build_gradients' place in the pipeline, and optimizer_step
then updates the parameters from `P.grad` as it would a backprop gradient.

Rewrite (the formulas are in fblc.compiler.es): adds the input `noise` [P, D] (role `noise`; D
the trainable values, parameters flattened in input order), then for each of the 2P members
(+eps_1 .. +eps_P, -eps_1 .. -eps_P) a copy of every node that reads a parameter, reading
theta +/- sigma eps_i instead (the nodes that read no parameter are shared); each member's
reward (`--reward`), the outputs `rewards` [2P] and `reward_mean` (role `metric`) after `loss`
(the unperturbed model's), and `P.grad` = -sigma g for every parameter. With `--reward external`
`rewards` is an input (role `reward`) and each member's model output an output `member_<m>`.
Member m's nodes are named `es/member_<m>/...`. Nothing is saved for a backward: member m's
activations are dead once its reward is made.

With EsConfig.loop (`fblc compile`, not `fblc train-graph`) and a reward the step computes, the members are one
copy, `es/member/...`, indexed by the member counter a loop of the kernel plan carries (fblc.compiler.es_loop):
the graph inputs `es.member` and `es.rewards` (role `carried`) and outputs `es.member.next`, `es.rewards.next`;
`rewards` is then `es.rewards` as the loop leaves it, and the model's `fblc.es` gains `loop`: 2P (else 0).

Preconditions: attach_loss ran; parameters are graph inputs with role `param`. In place.
Errors: pairs < 1, sigma <= 0, an unknown reward; `accuracy` without class labels.
"""

from __future__ import annotations

import json

import numpy as np
import onnx_ir as ir

from fblc.compiler import keys
from fblc.compiler.es import (EXTERNAL, LOSS_ONLY_REWARDS, MEMBER_OUTPUT, NOISE, REWARD_BUILDERS, REWARD_MEAN,
                              REWARDS_OUTPUT, EsConfig,
                              direction, flat_slice, member_forward, param_dependents, perturbed_forward, z_scores)
from fblc.compiler.es_loop import CARRIED_REWARDS, MEMBER, carried_input, member_perturbation, next_rewards
from fblc.compiler.graph import Emitter, static_shape
from fblc.compiler.keys import Role
from fblc.passes.build_gradients import trainable_params
from fblc.passes.contracts import ContractPass


def _prediction(graph: ir.Graph) -> ir.Value | None:
    for node in graph:
        for value in node.outputs:
            if value.metadata_props.get(keys.PREDICTION):
                return value
    return next((v for v in graph.inputs if v.metadata_props.get(keys.PREDICTION)), None)


def _unrolled_members(e: Emitter, graph: ir.Graph, forward: list[ir.Node], params: list[ir.Value], noise: ir.Value,
                      config: EsConfig, loss: ir.Value, prediction: ir.Value, labels: ir.Value | None
                      ) -> tuple[ir.Value, list[ir.Value]]:
    """2P copies of the member forward: (the rewards [2P], the outputs that report them)."""
    rewards, members = [], []
    for sign in (1.0, -1.0):
        for row in range(config.pairs):
            member = len(rewards) + len(members) + 1
            e.prefix = f"es/member_{member}"  # the member's perturbation, forward copy and reward
            member_loss, member_prediction = member_forward(e, forward, params, noise, row, sign, config.sigma,
                                                            [loss, prediction])
            if config.reward == EXTERNAL:
                members.append(e.op("Identity", member_prediction, name=MEMBER_OUTPUT.format(member)))
                keys.set_role(members[-1], Role.METRIC)
            else:
                reward = REWARD_BUILDERS[config.reward](e, member_loss, member_prediction, labels)
                rewards.append(e.reshape(reward, [1]))
    e.prefix = "es"
    if config.reward != EXTERNAL:
        reward_vector = e.op("Concat", *rewards, axis=0, name=REWARDS_OUTPUT)
        keys.set_role(reward_vector, Role.METRIC)
        return reward_vector, [reward_vector]
    reward_vector = ir.Value(name=REWARDS_OUTPUT, shape=ir.Shape([2 * config.pairs]),
                             type=ir.TensorType(ir.DataType.FLOAT))
    keys.set_role(reward_vector, Role.REWARD)
    graph.inputs.insert(graph.inputs.index(noise), reward_vector)
    return reward_vector, members


def _looped_members(e: Emitter, graph: ir.Graph, forward: list[ir.Node], params: list[ir.Value], noise: ir.Value,
                    config: EsConfig, loss: ir.Value, prediction: ir.Value, labels: ir.Value | None,
                    carried: list[ir.Value]) -> tuple[ir.Value, list[ir.Value]]:
    """One member forward indexed by the counter the plan's loop carries (fblc.compiler.es_loop): (the rewards
    [2P] after the loop, `carried` with the loop's next values added)."""
    count = 2 * config.pairs
    member = carried_input(graph, MEMBER, np.zeros((), np.float32), noise)
    filled = carried_input(graph, CARRIED_REWARDS, np.zeros(count, np.float32), noise)
    e.prefix = "es/member"
    eps, scale, following_member = member_perturbation(e, member, noise, config.sigma)
    member_loss, member_prediction = perturbed_forward(e, forward, params, eps, scale, [loss, prediction])
    reward = e.reshape(REWARD_BUILDERS[config.reward](e, member_loss, member_prediction, labels), [1])
    following = [next_rewards(e, member, reward, filled), following_member]
    e.prefix = "es"
    reward_vector = e.op("Identity", filled, name=REWARDS_OUTPUT)
    keys.set_role(reward_vector, Role.METRIC)
    return reward_vector, carried + following


class EsGradients(ContractPass):
    """Antithetic ES members, rewards and the gradient estimate of every parameter (in place)."""

    name = "es_gradients"
    requires_facts = ("static shapes", "trainable inputs", "loss")
    ensures_facts = ("gradients", "static shapes")

    def __init__(self, config: EsConfig) -> None:
        super().__init__()
        self.config = config

    def call(self, model: ir.Model) -> ir.passes.PassResult:
        config = self.config
        config.validate()
        graph = model.graph
        loss, carried = graph.outputs[0], list(graph.outputs[1:])
        params = trainable_params(graph)
        width = sum(int(np.prod(static_shape(p), dtype=np.int64)) for p in params)
        noise = ir.Value(name=NOISE, shape=ir.Shape([config.pairs, width]), type=ir.TensorType(ir.DataType.FLOAT))
        keys.set_role(noise, Role.NOISE)
        graph.inputs.insert(graph.inputs.index(params[0]), noise)
        # attach_loss marks the value the loss reads; chunk_loss took it away where the reward reads the loss alone
        prediction = _prediction(graph)
        assert prediction is not None or config.reward in LOSS_ONLY_REWARDS, "no value is marked as the prediction"
        labels = next((v for v in graph.inputs if keys.get_role(v) == Role.LABEL.value), None)
        forward = param_dependents(graph, params)
        e = Emitter(graph, stage="es")
        looped = config.loop and config.reward != EXTERNAL  # an external reward reads every member's output
        if looped:
            reward_vector, carried = _looped_members(e, graph, forward, params, noise, config, loss, prediction,
                                                     labels, carried)
            reported = [reward_vector]
        else:
            reward_vector, reported = _unrolled_members(e, graph, forward, params, noise, config, loss, prediction,
                                                        labels)
        mean = e.op("ReduceMean", reward_vector, keepdims=0, name=REWARD_MEAN)
        keys.set_role(mean, Role.METRIC)
        estimate = e.op("Mul", direction(e, z_scores(e, reward_vector), noise), e.scalar(-config.sigma, noise))
        grads, offset = [], 0
        for param in params:
            shape = static_shape(param)
            grad = e.op("Identity", flat_slice(e, estimate, offset, shape), name=f"{param.name}.grad")
            keys.set_role(grad, Role.GRAD)
            grads.append(grad)
            offset += int(np.prod(shape, dtype=np.int64))
        graph.outputs.clear()
        graph.outputs.extend([loss, *reported, mean, *grads, *carried])
        model.metadata_props[keys.ES] = json.dumps({"pairs": config.pairs, "sigma": config.sigma,
                                                    "reward": config.reward, "seed": config.seed, "values": width,
                                                    "loop": 2 * config.pairs if looped else 0})
        return ir.passes.PassResult(model, True)
