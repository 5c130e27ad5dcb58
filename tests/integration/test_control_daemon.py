"""The controller in the running daemon, driven over HTTP only.

A real Daemon (uvicorn on a loopback port, tiny random Llama, virtual GPU in control
mode, control loop in auto mode) serves a steady stream of completions from client
threads. The test measures what this load draws with the SM clock pinned at the top and
at the bottom of the ladder (manual mode, PUT /v1/control/knobs), sets a budget between
the two and hands control back with PUT /v1/control/policy in auto mode while the clock
is still pinned at the top, and reads the power that follows from the device's energy
counter in /v1/status: it must settle below the budget. The budget lies under the
virtual GPU's power-limit minimum, so only the controller's clock choice, not the
hardware limit, can hold it. The decision is also visible where an operator looks:
/v1/status, /metrics and the live feed's events.
"""

from __future__ import annotations

import threading
import time

import httpx

from tests.api_server import running_server
from wattserve.daemon.config import load_config

TOKEN = "control-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
CLIENTS = 6
LOAD_DEADLINE_S = 120.0  # the load threads stop by themselves after this


def _config(tmp_path):
    return load_config(
        None,
        {
            "server": {"port": 0, "drain_timeout_s": 5.0, "log_level": "warning"},
            "engine": {
                "kv_cache_bytes": 4 << 20,
                "max_model_len": 256,
                "default_max_tokens": 16,
                "max_num_seqs": 16,
                "quantization_levels": ["fp32"],
            },
            "device": {"backend": "virtual", "mode": "control", "state_dir": str(tmp_path)},
            "controller": {"mode": "auto", "power_budget_w": 700.0, "period_s": 0.1},
            "mqtt": {"enabled": False},
        },
    )


def _energy_j(client: httpx.Client) -> tuple[float, float]:
    t = client.get("/v1/status").json()["device"]["telemetry"]
    return t["timestamp_s"], t["energy_j"]


def _mean_power_w(client: httpx.Client, seconds: float) -> float:
    """Mean power over the next `seconds`, from the energy counter /v1/status shows."""
    t0, e0 = _energy_j(client)
    time.sleep(seconds)
    t1, e1 = _energy_j(client)
    assert t1 > t0
    return (e1 - e0) / (t1 - t0)


def _load(base_url: str, model: str, stop: threading.Event, errors: list[str]) -> None:
    body = {
        "model": model,
        "prompt": "power budget " * 6,
        "max_tokens": 24,
        "temperature": 0.0,
        "ignore_eos": True,
    }
    deadline = time.monotonic() + LOAD_DEADLINE_S
    with httpx.Client(base_url=base_url, timeout=30) as c:
        while not stop.is_set() and time.monotonic() < deadline:
            r = c.post("/v1/completions", json=body)
            if r.status_code != 200:
                errors.append(f"{r.status_code} {r.text[:200]}")
                return


def _put_policy(client: httpx.Client, **changes) -> dict:
    policy = client.get("/v1/control/policy", headers=AUTH).json()
    policy.update(changes)
    r = client.put("/v1/control/policy", json=policy, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()


def test_budget_set_over_the_api_is_held_by_the_running_daemon(tiny_llama, tmp_path):
    cfg = _config(tmp_path)
    with running_server(cfg, tiny_llama, environ={"WATTSERVE_API_TOKEN": TOKEN}) as srv:
        stop, errors = threading.Event(), []
        threads = [
            threading.Thread(
                target=_load,
                args=(srv.base_url, srv.daemon.state.served_model_name, stop, errors),
                daemon=True,
            )
            for _ in range(CLIENTS)
        ]
        with httpx.Client(base_url=srv.base_url, timeout=30) as client:
            for t in threads:
                t.start()
            try:
                ladder = client.get("/v1/status").json()["device"]["telemetry"][
                    "sm_clock_ladder_mhz"
                ]
                # What this load draws at either end of the ladder, knobs pinned by hand.
                _put_policy(client, mode="manual")
                r = client.put("/v1/control/knobs", json={"clock_mhz": ladder[-1]}, headers=AUTH)
                assert r.status_code == 200, r.text
                time.sleep(1.0)
                top_w = _mean_power_w(client, 1.5)
                r = client.put("/v1/control/knobs", json={"clock_mhz": ladder[0]}, headers=AUTH)
                assert r.status_code == 200, r.text
                time.sleep(1.0)
                bottom_w = _mean_power_w(client, 1.5)
                status = client.get("/v1/status").json()
                assert top_w - bottom_w > 10.0, (top_w, bottom_w)
                budget_w = round((top_w + bottom_w) / 2, 1)
                assert budget_w < status["device"]["telemetry"]["power_limit_min_w"]

                # Back to the top clock by hand: the controller takes over from there.
                r = client.put("/v1/control/knobs", json={"clock_mhz": ladder[-1]}, headers=AUTH)
                assert r.status_code == 200, r.text
                time.sleep(1.0)

                changed_at = time.time()
                _put_policy(client, mode="auto", power_budget_w=budget_w)
                time.sleep(3.0)  # settle
                after_w = [_mean_power_w(client, 1.0) for _ in range(4)]
                status = client.get("/v1/status").json()
                metrics = client.get("/metrics").text
            finally:
                stop.set()
                for t in threads:
                    t.join(40)
        events = srv.daemon.feed.recent_events()
    assert not errors, errors[:3]
    assert all(w <= budget_w for w in after_w), (top_w, bottom_w, budget_w, after_w)
    # It took over at the top clock (which drew top_w, over the budget) and stepped down.
    clock_after = status["controller"]["last_decision"]["knobs"]["sm_clock_mhz"]
    assert clock_after < ladder[-1], clock_after
    # The controller works against the new budget and says so where operators look.
    controller = status["controller"]
    assert controller["mode"] == "auto"
    assert controller["policy"]["power_budget_w"] == budget_w
    assert controller["last_decision"]["effective_budget_w"] == budget_w
    assert status["policy"]["power_budget_w"] == budget_w
    changes = [e for e in events if e.kind == "policy_changed"]
    assert changes[-1].data["changed_by"] == "http"
    assert changes[-1].data["policy"]["power_budget_w"] == budget_w
    decisions = [e for e in events if e.kind == "decision" and e.time_unix_s >= changed_at]
    assert decisions, "no decision event after the budget change"
    assert all(e.message and e.data["reason"] for e in decisions)
    assert any(e.data["knobs"]["sm_clock_mhz"] < ladder[-1] for e in decisions)
    assert "wattserve_controller_decisions_total{reason=" in metrics
    assert f"wattserve_power_budget_watts {budget_w}" in metrics
    assert "wattserve_gpu_power_watts " in metrics
    assert "wattserve_gpu_energy_joules_total " in metrics
