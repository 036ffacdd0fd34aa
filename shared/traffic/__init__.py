"""Served traffic read back: the TRAFFIC stream's records, and those records as a `kvmesh sim` trace."""
