"""Training across a fleet of devices with Flower (issue 43): ClientApps around fblc bundles, the ServerApp, a
real deployment (SuperLink / SuperNodes) and ES rounds that send seeds."""
