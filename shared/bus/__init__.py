"""NATS plumbing every service shares: connect, publish with retry, pull-consumer loop, request/reply."""
