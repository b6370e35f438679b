"""`fblc fleet simulate BUNDLE --data data.npz`: a fleet of simulated clients trains the bundle on Flower."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os

from fblc.cli.fleet_deploy import add_commands as add_deploy_commands
from fblc.cli.options import add_strategy_options

DESCRIPTION = (
    "Train BUNDLE across a fleet of simulated clients with Flower's simulation engine (Ray) on this machine: the "
    "rows of --data (one array per model input and 'labels') lose a --holdout part to the server's evaluation and "
    "are split among --clients by --partition; each round Flower samples --fraction of the clients, each trains "
    "--local-steps steps from the global tensors on its own rows on --device and returns only what trains (under "
    "an adapter, the adapter's tensors), and --strategy aggregates them. Prints a line per round, then a table "
    "against the same number of steps trained centrally; with -o writes fleet.json, fleet.png (accuracy or loss "
    "and bytes per round) and global.npz (the final global tensors: 'fblc export BUNDLE --params global.npz').")


def cmd_simulate(args: argparse.Namespace) -> int:
    from fblc.cli.outputs import save_parameters
    from fblc.errors import FblcError
    from fblc.fleet import report
    from fblc.fleet.client import FleetSpec
    from fblc.fleet.server import ServerSpec
    from fblc.fleet.simulate import central, clients_per_round, simulate

    if importlib.util.find_spec("flwr") is None:
        raise FblcError("fblc fleet needs Flower, which is not installed", "pip install 'fblc[fleet]'")
    if args.clients < 1 or args.rounds < 1 or args.local_steps < 1:
        raise FblcError("--clients, --rounds and --local-steps take positive integers", "e.g. --clients 20")
    if not 0 < args.fraction <= 1:
        raise FblcError(f"--fraction {args.fraction} is not in (0, 1]", "e.g. --fraction 0.1")
    if not 0 < args.holdout < 1:
        raise FblcError(f"--holdout {args.holdout} is not in (0, 1)", "e.g. --holdout 0.2")
    if args.output and os.path.exists(args.output) and not os.path.isdir(args.output):
        raise FblcError(f"-o '{args.output}' is a file, not a folder", "give a folder for fleet.json, fleet.png and "
                        "global.npz")
    if args.es_seeds:
        from fblc.fleet.es_seeds import es_spec

        if args.strategy != "fedavg":
            raise FblcError(f"--es-seeds replays the clients' steps and averages them: --strategy {args.strategy} "
                            "does not apply", "drop --strategy")
        es_spec(args.bundle)  # refuses a bundle whose steps cannot be replayed, before Ray starts
    fleet = FleetSpec(args.bundle, args.data, args.clients, args.partition, args.local_steps, args.device, args.step,
                      args.holdout, args.seed)
    server = ServerSpec(rounds=args.rounds, strategy=args.strategy, fraction=args.fraction,
                        min_available=args.min_available or args.clients, local_steps=args.local_steps,
                        proximal_mu=args.proximal_mu, lr=args.lr, eta=args.eta, timeout=args.timeout,
                        es_seeds=args.es_seeds)
    say = (lambda line: None) if args.quiet else print
    say(f"fleet: {args.clients} clients ({args.partition}), {clients_per_round(fleet, server)} per round, "
        f"{args.rounds} rounds of {args.local_steps} local steps on {args.device}, {args.strategy}")
    history = simulate(fleet, server, workers=args.workers, say=say, flower_log=args.flower_log)
    reference = None if args.no_central else central(fleet, server, say)
    full = report.model_bytes(args.bundle)
    say(report.table(history.rounds, reference))
    replied = [r for r in history.rounds if r.get("clients")]
    if not replied:
        raise FblcError(f"no client replied in any of the {args.rounds} rounds", "Flower's log above says why")
    sent = replied[-1]["bytes_up_per_client"]
    say(f"bytes up per client per round: {sent:,.0f} B, {100 * sent / full:.2f} % of the model's {full:,} B of "
        f"weights")
    if args.output:
        os.makedirs(args.output, exist_ok=True)
        files = report.saved_files(args.output)
        report.save_json(files["history"], {"rounds": history.rounds, "central": reference, "model_bytes": full,
                                            "fleet": dataclasses.asdict(fleet), "server": dataclasses.asdict(server)})
        report.plot(history.rounds, reference, files["plot"],
                    f"{args.clients} clients, {args.partition}, {args.strategy}")
        save_parameters(files["params"], history.final)
        say(f"wrote {files['history']}, {files['plot']} and {files['params']}")
    return 0


def add_command(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    fleet = commands.add_parser("fleet", help="train across a fleet of devices on Flower (simulate)",
                                description="Federated training of a bundle on Flower.")
    verbs = fleet.add_subparsers(dest="fleet_command", metavar="VERB", required=True)
    simulate = verbs.add_parser("simulate", help="simulate a fleet of clients on this machine",
                                description=DESCRIPTION)
    simulate.add_argument("bundle", help="bundle folder from 'fblc compile'")
    simulate.add_argument("--data", required=True, metavar="DATA.npz", help="the rows to split among the clients")
    simulate.add_argument("--clients", type=int, default=10, help="simulated clients (default 10)")
    simulate.add_argument("--rounds", type=int, default=10, help="rounds (default 10)")
    simulate.add_argument("--partition", default="iid", metavar="iid|dirichlet:ALPHA|by-label",
                          help="how the rows are split among clients (default iid)")
    simulate.add_argument("--local-steps", type=int, default=5, help="steps each client trains per round (default 5)")
    simulate.add_argument("--device", default="local",
                          help="where clients train: local (the bundle's kernels on the local OpenCL device), "
                               "opencl:P:D, or graph (the step ONNX of --step in onnxruntime; default local)")
    simulate.add_argument("--step", metavar="STEP.onnx",
                          help="for --device graph: the step 'fblc train-graph' wrote with the bundle's options")
    simulate.add_argument("--fraction", type=float, default=1.0, help="fraction of clients per round (default 1)")
    simulate.add_argument("--min-available", type=int, default=0,
                          help="clients that must be connected before a round starts (default all)")
    simulate.add_argument("--timeout", type=float, default=3600.0, help="seconds a round waits for replies")
    add_strategy_options(simulate)
    simulate.add_argument("--es-seeds", action="store_true",
                          help="ES bundles (--trainer es, SGD): clients send seeds and member rewards, not tensors, "
                               "and the server replays their steps")
    simulate.add_argument("--holdout", type=float, default=0.2, help="fraction of rows held out (default 0.2)")
    simulate.add_argument("--seed", type=int, default=0, help="seed of the split and the batches")
    simulate.add_argument("--workers", type=int, default=2, help="Ray worker processes (default 2)")
    simulate.add_argument("--no-central", action="store_true", help="skip the central run")
    simulate.add_argument("--flower-log", action="store_true", help="show Flower's and Ray's own log")
    simulate.add_argument("-o", "--output", metavar="FOLDER", help="write fleet.json, fleet.png and global.npz here")
    simulate.add_argument("--debug", action="store_true", help="show tracebacks of errors")
    simulate.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")
    simulate.set_defaults(run=cmd_simulate)
    add_deploy_commands(verbs)  # serve, join: a deployment on Flower's SuperLink and SuperNodes
