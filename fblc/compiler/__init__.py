"""Graph-level compiler: import, autodiff, losses, optimizers, the training-graph driver.

Imports nothing from the other fblc subpackages (docs/ARCHITECTURE.md, section 7).
"""
