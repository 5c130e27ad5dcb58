"""The simulator the control benches and tests share: the real engine's step times
(calibration), an engine in simulated time (engine model), seeded workloads (scenarios),
and a runner that drives one system over one scenario on the virtual GPU (run, systems,
metrics).

It is built from the daemon's own parts (scheduler, KV cache, virtual device, ControlLoop),
which wattserve/controller/ must not import; the daemon may use it. It must never import
`wattserve.bench`: the bench commands import it, not the other way round.
"""
