"""Credentials a stack generates once and keeps in its state dir: S3 keys, NATS users and their passwords."""
