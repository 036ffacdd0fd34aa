"""The service runner every kvmesh service is built on: NATS, HTTP side server, heartbeat, drain."""
