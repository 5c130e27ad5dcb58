"""The simulator the control benches and tests share: the real engine's step times
(calibration), an engine in simulated time (engine model), seeded workloads (scenarios),
and a runner that drives one system over one scenario on the virtual GPU (run, systems,
metrics).

It lives under daemon/ because it is built from the daemon's own parts (scheduler, KV
cache, virtual device, ControlLoop); controller/ stays pure. It must never import
`bench`: the bench commands import it, not the other way round.
"""
