"""Prometheus metrics of one service process, in a registry of its own.

The runner creates one `ServiceMetrics` per process and serves its registry
on `/metrics`; nothing registers on prometheus_client's global default
registry, so several runners (tests) coexist in one process. Services add
their own collectors with `metrics.registry` as the `registry=` argument and
`kvmesh_` names.

Message counters are labelled by `subject` = the consumer's filter subject
(a pattern such as `kvmesh.jobs.prefill.w1`), never by per-request subjects,
so label cardinality stays bounded.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    generate_latest,
)

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class ServiceMetrics:
    """The standard kvmesh_* collectors every service exports."""

    registry: CollectorRegistry
    messages_handled: Counter
    messages_failed: Counter
    messages_redelivered: Counter
    messages_dead_lettered: Counter
    messages_in_flight: Gauge
    handler_seconds: Histogram
    publish_retries: Counter
    requests_failed: Counter
    heartbeat_age_seconds: Gauge
    heartbeat_failures: Counter

    @classmethod
    def create(cls, service: str = "") -> ServiceMetrics:
        """A fresh registry with the standard collectors, plus `kvmesh_service_info{service=...}`."""
        reg = CollectorRegistry(auto_describe=True)
        Info("kvmesh_service", "Which service this process runs.", registry=reg).info({"service": service})

        def counter(name: str, doc: str, labels: tuple[str, ...] = ("subject",)) -> Counter:
            return Counter(name, doc, labels, registry=reg)

        return cls(
            registry=reg,
            messages_handled=counter("kvmesh_messages_handled", "Messages whose handler succeeded (acked)."),
            messages_failed=counter("kvmesh_messages_failed", "Handler failures (each one naks or dead-letters)."),
            messages_redelivered=counter("kvmesh_messages_redelivered", "Deliveries with a delivery count above 1."),
            messages_dead_lettered=counter(
                "kvmesh_messages_dead_lettered", "Messages terminated and copied to a dead-letter subject."
            ),
            messages_in_flight=Gauge(
                "kvmesh_messages_in_flight", "Messages whose handler is running now.", ("subject",), registry=reg
            ),
            handler_seconds=Histogram(
                "kvmesh_handler_seconds", "Handler wall time per message.", ("subject",),
                buckets=_LATENCY_BUCKETS, registry=reg,
            ),
            publish_retries=counter(
                "kvmesh_publish_retries", "JetStream publish attempts that failed and were retried."
            ),
            requests_failed=counter("kvmesh_requests_failed", "Request/reply calls that timed out or failed."),
            heartbeat_age_seconds=Gauge(
                "kvmesh_heartbeat_age_seconds", "Seconds since this process last wrote its heartbeat.", registry=reg
            ),
            heartbeat_failures=Counter(
                "kvmesh_heartbeat_failures", "Heartbeat writes that failed (the entry expires a TTL after the last "
                "one that succeeded).", registry=reg,
            ),
        )

    def render(self) -> tuple[bytes, str]:
        """The text exposition of this registry and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

