"""wattserve's numeric hot paths (DESIGN.md's `kernels/`): paged attention, packed linear
layers, RMSNorm and RoPE, weight quantization, each with a plain-torch reference.

Named `wattserve.kernels`, not `kernels`: transformers (5.25 on) depends on the PyPI
`kernels` distribution and imports it by that name, which a top-level `kernels` package
of ours would shadow. Nothing here imports the engine or the daemon.
"""
