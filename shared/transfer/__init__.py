"""Moving KV blocks between workers: the transport interface and the batch wire format."""
