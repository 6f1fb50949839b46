"""Sweeps: Ray Tune over the train job, each trial a run."""
