"""Training with Ray Train: the driver, each worker's loop, its input paths, the optimizer."""
