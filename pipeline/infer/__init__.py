"""Batch inference on Ray Data from a training run's best checkpoint."""
