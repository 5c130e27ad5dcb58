"""wattserve: a power-aware LLM inference daemon, installed under this one import name.

Subpackages: `daemon` (the serving process), `controller` (pure decision logic), `kernels`
(numeric hot paths), `fleet` (site budgets across daemons), `sim` (the engine model the
benches and tests drive) and `bench` (the benchmark commands). Importing this package
imports none of them.
"""
