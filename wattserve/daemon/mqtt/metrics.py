"""Prometheus view of the MQTT link: connection state, published, queued and dropped counts.

Register `MqttCollector(link)` on the app's registry; it reads `link.stats()` at scrape
time. Kept apart from the link so the link itself needs no prometheus-client.
This module must not change the link.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from wattserve.daemon.mqtt.link import MqttLink

PREFIX = "wattserve_mqtt"


class MqttCollector(Collector):
    def __init__(self, link: MqttLink) -> None:
        self._link = link

    def collect(self) -> Iterator[Metric]:
        s = self._link.stats()
        yield GaugeMetricFamily(
            f"{PREFIX}_connected", "1 while connected to the MQTT broker", value=int(s.connected)
        )
        yield CounterMetricFamily(
            f"{PREFIX}_connects", "Successful connections to the broker", value=s.connects
        )
        yield CounterMetricFamily(
            f"{PREFIX}_connect_failures",
            "Connection attempts that failed",
            value=s.connect_failures,
        )
        yield CounterMetricFamily(
            f"{PREFIX}_connection_losses",
            "Established connections that were lost",
            value=s.connection_losses,
        )
        published = CounterMetricFamily(
            f"{PREFIX}_messages_published", "Messages published, by kind", labels=["kind"]
        )
        for kind, n in sorted(s.published.items()):
            published.add_metric([kind], n)
        yield published
        dropped = CounterMetricFamily(
            f"{PREFIX}_messages_dropped",
            "Messages dropped because their queue was full, by kind",
            labels=["kind"],
        )
        dropped.add_metric(["telemetry"], s.dropped_telemetry)
        dropped.add_metric(["event"], s.dropped_events)
        yield dropped
        queued = GaugeMetricFamily(
            f"{PREFIX}_messages_queued", "Messages waiting to be published", labels=["kind"]
        )
        queued.add_metric(["telemetry"], s.queued_telemetry)
        queued.add_metric(["event"], s.queued_events)
        yield queued
        policy = CounterMetricFamily(
            f"{PREFIX}_policy_set_messages", "policy/set messages by outcome", labels=["outcome"]
        )
        policy.add_metric(["accepted"], s.policy_set_accepted)
        policy.add_metric(["rejected"], s.policy_set_rejected)
        policy.add_metric(["retained_ignored"], s.policy_set_retained_ignored)
        yield policy
        yield CounterMetricFamily(
            f"{PREFIX}_telemetry_source_errors",
            "Telemetry ticks whose snapshot could not be built",
            value=s.telemetry_source_errors,
        )
