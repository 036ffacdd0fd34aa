"""A request's run on the bus: the gateway, and the run that publishes, watches, retries and delivers in order."""
