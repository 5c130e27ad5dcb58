"""Fleet power budgets: one site budget shared by many wattserve nodes (docs/fleet.md).

`fleet.allocation` is the pure water-filling of one round; `fleet.allocator` the stateful
allocator (leases, hysteresis, slow jittered give-backs, silent nodes, the site meter).
Like `controller/`, this package holds decision logic only: no I/O, no clocks of its own,
no MQTT, no torch. The process that runs it is `daemon/fleet_service.py`.
"""
