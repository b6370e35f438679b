"""Graph-to-graph passes, one per module; `pipeline.py` holds the one ordered list."""
