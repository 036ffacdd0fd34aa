"""What travels on NATS: versioned message models, subject names, stream and bucket definitions."""
