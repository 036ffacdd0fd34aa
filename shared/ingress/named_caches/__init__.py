"""Named caches: a stored prefix (messages, tools) a request names by `cache_id`."""
