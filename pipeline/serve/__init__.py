"""Online classification behind HTTP with Ray Serve, from a run's best checkpoint."""
