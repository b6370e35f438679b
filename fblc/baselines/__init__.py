"""Other compilers run on fblc's training steps, as references and as the baselines fblc must beat."""
