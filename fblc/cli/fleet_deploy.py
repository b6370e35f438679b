"""`fblc fleet serve` and `fblc fleet join`: a deployment on Flower's SuperLink and SuperNodes (fblc.fleet.deploy)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

SERVE = ("Start a Flower SuperLink on this machine and run the fleet's ServerApp on it: each round sends the global "
         "trainable tensors of BUNDLE to the joined SuperNodes, each trains --local-steps steps on its own data and "
         "device, and FedAvg (weighted by examples) averages what comes back. A client that fails, or sends nothing "
         "within --round-timeout, is left out of its round and the log says why. Prints Flower's log, one line per "
         "round (clients averaged, mean loss, bytes uploaded per client); writes OUT/round-R.npz, OUT/rounds.jsonl "
         "and OUT/global.npz. Every process it started is stopped at the end.")
JOIN = ("Start a Flower SuperNode that joins the SuperLink at --superlink and trains BUNDLE on --device with the "
        "rows of --data (which stay on this machine: only the trainable tensors and the metrics num-examples, "
        "train-loss and bytes-up are sent) in every round it is sampled for. Runs until stopped (Ctrl-C, SIGTERM), "
        "then stops every process it started.")


def add_commands(fleet: Any) -> None:
    """`serve` and `join` under the `fleet` command's subparsers."""
    from fblc.cli import deferred
    from fblc.cli.options import add_strategy_options

    serve = fleet.add_parser("serve", help="run a SuperLink and the fleet's rounds", description=SERVE)
    serve.add_argument("bundle", help="the compiled bundle (every client trains one compiled from the same model)")
    serve.add_argument("--rounds", type=int, default=3, help="federated rounds (default 3)")
    serve.add_argument("--local-steps", type=int, default=5, help="steps each client trains per round (default 5)")
    serve.add_argument("--min-clients", type=int, default=2,
                       help="SuperNodes every round waits for (connected), and the least it samples (default 2); "
                            "below the fleet's size, rounds go on without a node that left")
    serve.add_argument("--fraction", type=float, default=1.0, help="fraction of connected clients per round")
    serve.add_argument("--round-timeout", type=float, default=600.0,
                       help="seconds a round waits for replies; later ones are left out (default 600)")
    serve.add_argument("--wait-clients", type=float, default=600.0, metavar="SECONDS",
                       help="how long a round waits for --min-clients SuperNodes to be connected; then the run stops "
                            "with the global model so far in OUT/global.npz (default 600; 0: without limit)")
    serve.add_argument("--port", type=int, default=9092, help="the SuperLink's port (default 9092)")
    add_strategy_options(serve)
    serve.add_argument("--es-seeds", action="store_true",
                       help="ES bundles (--trainer es, SGD): clients send seeds and rewards, not tensors")
    serve.add_argument("--keep-replies", action="store_true",
                       help="also write what each client sent, per round (OUT/round-R-replies.npz), for inspection")
    serve.add_argument("-o", "--out", required=True, help="folder for the rounds' models and log")
    serve.set_defaults(run=deferred("fblc.cli.fleet_deploy", "cmd_serve"))

    join = fleet.add_parser("join", help="run a SuperNode that trains on one device", description=JOIN)
    join.add_argument("bundle", help="the compiled bundle this client trains")
    join.add_argument("--superlink", required=True, metavar="HOST:PORT", help="the SuperLink's address")
    join.add_argument("--device", default="local", help="local (this machine's OpenCL) or adb:SERIAL (a phone)")
    join.add_argument("--data", required=True, help="this client's .npz (as for fblc run); it never leaves")
    join.add_argument("--runner", help="the native runner for adb:SERIAL (default: the built one)")
    join.add_argument("--port", type=int, help="the SuperNode's ClientApp API port (default: a free one)")
    join.set_defaults(run=deferred("fblc.cli.fleet_deploy", "cmd_join"))
    for sub in (serve, join):  # the top level adds these to `fleet` itself, whose subcommands parse the rest
        sub.add_argument("--debug", action="store_true", help="show tracebacks of errors")
        sub.add_argument("-q", "--quiet", action="store_true", help="print nothing but errors")


def _say(line: str) -> None:
    print(f"fleet: {line}", flush=True)


def cmd_serve(args: argparse.Namespace) -> int:
    from fblc import bundle_format as fmt
    from fblc.errors import FblcError
    from fblc.fleet.deploy import serve
    from fblc.fleet.deploy_apps import STOPPED

    fmt.load_verified(args.bundle)
    for name in ("rounds", "local_steps", "min_clients"):
        if getattr(args, name) < 1:
            raise FblcError(f"--{name.replace('_', '-')} {getattr(args, name)} is not a positive number")
    if args.es_seeds:
        from fblc.fleet.es_seeds import es_spec

        if args.strategy != "fedavg":
            raise FblcError(f"--es-seeds replays the clients' steps and averages them: --strategy {args.strategy} "
                            "does not apply", "drop --strategy")

        es_spec(args.bundle)  # refuses a bundle whose steps cannot be replayed, before any process starts
    if args.wait_clients < 0:
        raise FblcError(f"--wait-clients {args.wait_clients} is negative", "give seconds, or 0 to wait without limit")
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    stopped = os.path.join(out, STOPPED)
    if os.path.exists(stopped):  # of an earlier run into this folder
        os.remove(stopped)
    config = {"bundle": os.path.abspath(args.bundle), "out": out, "rounds": args.rounds,
              "local-steps": args.local_steps, "min-clients": args.min_clients, "fraction": args.fraction,
              "round-timeout": args.round_timeout, "wait-clients": args.wait_clients, "es-seeds": bool(args.es_seeds),
              "strategy": args.strategy, "proximal-mu": args.proximal_mu, "proximal-lr": args.lr, "eta": args.eta,
              "keep-replies": bool(args.keep_replies)}
    code = serve(config, args.port, out, _say)
    if os.path.exists(stopped):
        with open(stopped, encoding="utf-8") as handle:
            stop = json.load(handle)
        print(f"fblc: error: the fleet stopped before round {stop['round']}: only {stop['connected']} of the "
              f"{stop['needed']} SuperNodes it needs (--min-clients) were connected after {stop['waited']:g} s "
              f"(--wait-clients); the global model of the {stop['round'] - 1} rounds that ran is "
              f"{os.path.join(out, 'global.npz')}", file=sys.stderr)
        return 3
    if code == 0 and os.path.exists(os.path.join(out, "global.npz")):
        _say(f"done: {args.rounds} rounds; the global model is {os.path.join(out, 'global.npz')}")
        return 0
    print(f"fblc: error: the fleet run failed (flwr run exited {code}); see the log above and "
          f"{os.path.join(out, 'superlink.log')}", file=sys.stderr)
    return 2


def cmd_join(args: argparse.Namespace) -> int:
    from fblc import bundle_format as fmt
    from fblc.cli.data import batches
    from fblc.fleet.deploy import join
    from fblc.fleet.trainers import device_kind

    manifest, _ = fmt.load_verified(args.bundle)
    device_kind(args.device)  # an unknown device is refused before joining
    batches(args.data, manifest)  # refuses a data file the bundle cannot train on before joining
    node = {"bundle": os.path.abspath(args.bundle), "data": os.path.abspath(args.data), "device": args.device,
            "runner": os.path.abspath(args.runner) if args.runner else ""}
    return join(args.superlink, node, args.port, _say)
