"""Fleet power budgets: one site budget shared by many wattserve nodes (docs/fleet.md).

`allocation` is the pure water-filling of one round; `allocator` the stateful allocator
(leases, hysteresis, slow jittered give-backs, silent nodes, the site meter) and `leader`
the single-writer election: decision logic only, no I/O, no clocks of their own, no MQTT,
no torch. The I/O lives beside them: `service` is the allocator's process
(`wattserve fleet`), `node` the daemon's side of the link (demands out, grants in).
"""
