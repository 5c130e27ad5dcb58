"""Runtime state of one serving process, kept on `app.state.serving`.

It holds what the API needs beyond the frozen config: the lifecycle phase (loading,
warming, ready, draining, failed), the engine once it exists, the admission count that bounds
the waiting queue, the bound on grammar compilations running at once, the stored control
policy and the resolved API token. Values derived at runtime live here and are never written
back into the config. It must not speak HTTP; handlers translate its refusals
(`Unavailable`) into responses.
"""

from __future__ import annotations

import asyncio
import enum
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from wattserve.controller.policy import Policy
from wattserve.controller.schema import PolicyModel, PolicyPatch, to_model, to_policy
from wattserve.daemon.api.metrics import Metrics
from wattserve.daemon.config import Config, ConfigError
from wattserve.daemon.engine.engine import Engine
from wattserve.daemon.request_events import RequestEvents

if TYPE_CHECKING:
    from wattserve.daemon.api.generation import GenerationStream
    from wattserve.daemon.control_loop import ControlLoop
    from wattserve.daemon.device import ManagedDevice, TelemetrySampler
    from wattserve.daemon.feed import LiveFeed
    from wattserve.fleet.node import FleetNodeLink


class Phase(enum.Enum):
    LOADING = "loading"
    WARMING = "warming"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"  # the engine loop died; the process is exiting for a restart
    STOPPED = "stopped"


class Unavailable(Exception):
    """Admission refused; `reason` is an error code, `retry_after_s` a whole number of seconds."""

    def __init__(self, reason: str, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.reason = reason  # "overloaded" | "not_ready" | "draining" | "engine_failed"
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass
class ServingState:
    cfg: Config
    api_token: str | None
    metrics: Metrics = field(default_factory=Metrics)
    # Each request's FirstToken and RequestFinished go to these subscribers: the metrics
    # always, the feed and the control loop once the daemon has built them.
    request_events: RequestEvents = field(default_factory=RequestEvents)
    engine: Engine | None = None
    # The GPU (or virtual GPU) and its sampler, once opened; the control loop, once running.
    device: ManagedDevice | None = None
    device_sampler: TelemetrySampler | None = None
    control_loop: ControlLoop | None = None
    # Telemetry snapshots and events for the dashboard and MQTT.
    feed: LiveFeed | None = None
    # wattserve.fleet.node.FleetNodeLink with [fleet] enabled: the grant and lease, for status.
    fleet: FleetNodeLink | None = None
    phase: Phase = Phase.LOADING
    # The policy in force: from [controller] until HTTP or MQTT changes it; the control
    # loop's controller holds the same value once the loop runs.
    policy: Policy = field(init=False)
    in_flight: int = 0
    # Admitted requests by id, so a drain that times out can abort each one.
    live: dict[str, GenerationStream] = field(default_factory=dict)
    drain_deadline_s: float | None = None  # time.monotonic() when draining ends
    # Mean E2E latency of recent requests; the basis of Retry-After under overload.
    e2e_ewma_s: float | None = None
    created_at_s: float = field(default_factory=time.time)  # wall clock, for /v1/models
    # Grammar compilations running on the tokenization pool (server.max_concurrent_grammar_
    # compiles); requests beyond wait here, on the loop, holding no pool thread.
    grammar_compiles: asyncio.Semaphore = field(init=False)

    def __post_init__(self) -> None:
        self.policy = to_policy(self.cfg.controller)
        self.grammar_compiles = asyncio.Semaphore(self.cfg.server.max_concurrent_grammar_compiles)
        self.request_events.subscribe(self.metrics)

    @property
    def served_model_name(self) -> str | None:
        if self.engine is None:
            return None
        return self.cfg.engine.served_model_name or self.engine.model_name

    @property
    def is_ready(self) -> bool:
        return self.phase is Phase.READY

    @property
    def admission_cap(self) -> int:
        """Requests admitted at once: the running batch cap plus the bounded waiting queue."""
        running = self.engine.limits.max_num_seqs if self.engine is not None else 0
        return running + self.cfg.server.max_waiting_requests

    def apply_policy(self, edge: PolicyModel | PolicyPatch, changed_by: str) -> PolicyModel:
        """The one path for a new policy (HTTP PUT, MQTT policy/set): the fields `edge`
        carries over the policy in force, handed to the controller, kept for /v1/status,
        and said on the live feed. Returns the policy in force as the wire shows it."""
        policy = to_policy(edge, self.policy)
        if self.control_loop is not None:
            self.control_loop.set_policy(policy)
        self.policy = policy
        shown = to_model(policy)
        if self.feed is not None:
            self.feed.publish_event(
                "policy_changed",
                f"policy changed by {changed_by}: budget {shown.power_budget_w:g} W, "
                f"TTFT {shown.ttft_slo_ms:g} ms, TPOT {shown.tpot_slo_ms:g} ms, mode {shown.mode}",
                {"changed_by": changed_by, "policy": shown.model_dump(mode="json")},
            )
        return shown

    def admit(self) -> None:
        """Take one admission slot or raise Unavailable. Pair with release()."""
        if self.phase is Phase.DRAINING or self.phase is Phase.STOPPED:
            left = (self.drain_deadline_s or time.monotonic()) - time.monotonic()
            raise Unavailable(
                "draining", "the server is shutting down", max(1, math.ceil(left) + 1)
            )
        if self.phase is Phase.FAILED or (self.engine is not None and self.engine.fault):
            raise Unavailable("engine_failed", "the engine failed; the server is restarting", 5)
        if self.phase is not Phase.READY or self.engine is None:
            raise Unavailable("not_ready", "the model is still loading; retry shortly", 5)
        if self.in_flight >= self.admission_cap:
            raise Unavailable(
                "overloaded",
                f"server overloaded: {self.in_flight} requests in flight, the limit is "
                f"{self.admission_cap} (running cap + max_waiting_requests); retry later",
                self._retry_after_s(),
            )
        self.in_flight += 1

    def release(self, e2e_s: float | None = None) -> None:
        self.in_flight -= 1
        if e2e_s is not None:
            prev = self.e2e_ewma_s
            self.e2e_ewma_s = e2e_s if prev is None else 0.8 * prev + 0.2 * e2e_s

    def _retry_after_s(self) -> int:
        # A slot frees when a running request ends: about one mean request latency away.
        if self.e2e_ewma_s is None:
            return 1
        return min(60, max(1, math.ceil(self.e2e_ewma_s)))


def resolve_api_token(cfg: Config, environ: dict[str, str] | None = None) -> str | None:
    """The control token: WATTSERVE_API_TOKEN, else server.api_token, else server.api_token_file.

    Raises ConfigError for an empty token or an unreadable token file: a control surface
    that silently ends up without its token would be disabled for no visible reason.
    """
    env = os.environ if environ is None else environ
    if env.get("WATTSERVE_API_TOKEN") is not None:
        token, source = env["WATTSERVE_API_TOKEN"], "WATTSERVE_API_TOKEN"
    elif cfg.server.api_token is not None:
        token, source = cfg.server.api_token, "server.api_token"
    elif cfg.server.api_token_file is not None:
        path = Path(cfg.server.api_token_file).expanduser()
        try:
            token = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(
                f"config error: server.api_token_file: cannot read {path}: {e}"
            ) from None
        token, source = token.strip(), f"server.api_token_file ({path})"
    else:
        return None
    if not token.strip():
        raise ConfigError(f"config error: {source}: the API token is empty")
    if not token.isascii() or any(c.isspace() for c in token):
        raise ConfigError(f"config error: {source}: the API token must be ASCII without spaces")
    return token
