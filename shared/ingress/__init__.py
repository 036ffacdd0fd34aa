"""The ingress: the HTTP front door. Sub-packages follow a request top-down: dialects -> admission ->
routing -> supervision -> the dialect's output; core holds the types they share, server wires them."""
