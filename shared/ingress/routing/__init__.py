"""Where a request runs: the live worker table, the router and its cost model, prefill rates, the prefix
locator."""
