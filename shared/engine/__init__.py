"""The in-process engine: checkpoints, model, paged KV pool, prefix cache, scheduler."""
