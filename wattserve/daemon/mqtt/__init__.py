"""MQTT telemetry feed and remote policy (docs/mqtt.md): the link, its payloads, its window.

The daemon builds one MqttLink, starts it on its event loop and feeds it write-only
snapshots; nothing reads serving state back from it.
"""

from wattserve.daemon.mqtt.link import (
    Backoff,
    EventSink,
    LinkStats,
    MqttLink,
    PolicyHandler,
    TelemetrySource,
)
from wattserve.daemon.mqtt.payloads import (
    DeviceFigures,
    DeviceSummary,
    EventKind,
    EventPayload,
    KnobFigures,
    LatencyFigures,
    ServingFigures,
    StatusPayload,
    TelemetryPayload,
    Topics,
    policy_fields,
)
from wattserve.daemon.mqtt.window import TelemetryWindow, WindowFigures

__all__ = [
    "Backoff",
    "DeviceFigures",
    "DeviceSummary",
    "EventKind",
    "EventSink",
    "EventPayload",
    "KnobFigures",
    "LatencyFigures",
    "LinkStats",
    "MqttLink",
    "PolicyHandler",
    "ServingFigures",
    "StatusPayload",
    "TelemetryPayload",
    "TelemetrySource",
    "TelemetryWindow",
    "Topics",
    "WindowFigures",
    "policy_fields",
]
