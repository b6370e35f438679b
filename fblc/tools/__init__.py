"""Work over a whole build, above the runtimes: verify a bundle against onnxruntime, trace its reads
through the cache model, say what of a model fblc supports (coverage: `fblc check`), audit every registry
(python -m fblc.tools.op_audit > docs/OPS.md)."""
