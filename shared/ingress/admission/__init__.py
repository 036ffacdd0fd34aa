"""Everything a request passes before anything is published: auth, rate and size limits, body and model
checks, the context budget, the tenant salts, pin budgets."""
