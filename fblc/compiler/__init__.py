"""Graph-level compiler: import, autodiff, losses, optimizers, the training-graph driver.

Imports nothing from the other fblc subpackages (DESIGN.md section 2).
"""
