"""kvmesh common library: config, bus, protocol, engine, tiers, policies."""
