"""The ingress's Prometheus collectors (kvmesh_ingress_*), on the service's registry."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(slots=True)
class IngressMetrics:
    requests: Counter  # by route and status
    ttft_seconds: Histogram
    prompt_tokens: Counter
    cached_tokens: Counter
    completion_tokens: Counter
    retries: Counter
    stale_events: Counter  # token events of a replaced attempt (a zombie after a migration), dropped
    in_flight: Gauge
    sessions: Counter  # requests by where their session came from (identity.Source); never by session id
    session_parents: Counter  # requests of forked sessions, by where the parent came from (lineage.ParentSource)
    session_events: Counter  # published, by outcome
    session_event_failures: Counter  # session events that could not be published (the request still succeeds)
    outcome_checks: Counter  # a turn's published outcome against what the next request showed it was

    @classmethod
    def create(cls, registry: CollectorRegistry) -> IngressMetrics:
        return cls(
            requests=Counter("kvmesh_ingress_requests", "HTTP requests by route and status.",
                             ("route", "status"), registry=registry),
            ttft_seconds=Histogram("kvmesh_ingress_ttft_seconds", "Request start to first token.", ("route",),
                                   buckets=_TTFT_BUCKETS, registry=registry),
            prompt_tokens=Counter("kvmesh_ingress_prompt_tokens", "Prompt tokens served.", registry=registry),
            cached_tokens=Counter("kvmesh_ingress_cached_tokens", "Prompt tokens served from cache.",
                                  registry=registry),
            completion_tokens=Counter("kvmesh_ingress_completion_tokens", "Tokens generated.", registry=registry),
            retries=Counter("kvmesh_ingress_retries", "Prefill retries and decode migrations.", registry=registry),
            stale_events=Counter("kvmesh_ingress_stale_token_events", "Token events of an attempt already "
                                 "replaced (retry or migration), dropped unseen.", registry=registry),
            in_flight=Gauge("kvmesh_ingress_in_flight", "Requests being generated now.", registry=registry),
            sessions=Counter("kvmesh_ingress_sessions", "Requests by the source of their session: an explicit "
                             "field, inferred from the chain, or new.", ("source",), registry=registry),
            session_parents=Counter("kvmesh_ingress_session_parents", "Requests whose session was forked from "
                                    "another (a sub-agent), by where its parent came from: a header, the body "
                                    "extension, Dynamo's header, or inferred from the chain.", ("source",),
                                    registry=registry),
            session_events=Counter("kvmesh_ingress_session_events", "Session events published, by outcome.",
                                   ("outcome",), registry=registry),
            session_event_failures=Counter("kvmesh_ingress_session_event_failures", "Session events not "
                                           "published (bus unavailable); the request was served.",
                                           registry=registry),
            outcome_checks=Counter("kvmesh_ingress_session_outcome_checks", "Turns whose next request arrived: "
                                   "the outcome published for the turn against the one the next request showed.",
                                   ("published", "actual"), registry=registry),
        )
