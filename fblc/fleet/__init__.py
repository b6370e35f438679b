"""Training across a fleet of devices on Flower (`pip install fblc[fleet]`): fblc bundles as Flower ClientApps.

- data.py: a data file's rows, the held-out part, the split among clients (iid, dirichlet:ALPHA, by-label);
- trainers.py: the bundle's step on a device kind (local OpenCL, or the step ONNX in onnxruntime), built once
  per process, the global tensors set and checked by name and shape;
- client.py: the ClientApp (K local steps on the client's rows; replies with the trainable tensors only);
- evaluate.py: the server's held-out evaluation of the exported global model;
- server.py: the ServerApp over Flower's FedAvg / FedProx / FedAdam;
- simulate.py: Flower's simulation engine on this machine, and the central run of the same number of steps;
- report.py: the table and the plot of `fblc fleet simulate`;
- deploy.py, deploy_apps.py, rounds.py: a real deployment on Flower's SuperLink and SuperNodes (`fblc fleet serve`,
  `fblc fleet join`), its ClientApp (each client's own data file and device: local or adb:SERIAL) and ServerApp
  (FedAvg that logs every client a round leaves out, and why);
- bundle_params.py: a round's global model written as the bundle's params.bin (the adb runner's `--params`);
- es_seeds.py: ES rounds whose clients send seeds and rewards, which the server replays.
Layering: fleet sits beside cli (which calls it), above runtime, codegen and compiler.
"""
