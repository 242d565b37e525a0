"""The stateless HTTP API: the reference daemon's routes, answered from the shared store."""
