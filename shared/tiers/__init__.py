"""KV blocks that travel: the block format, handles, and the L2 host / L3 S3 tiers."""
