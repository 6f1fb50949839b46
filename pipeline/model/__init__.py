"""The network, its checkpoints, a training run's record, and how a batch meets the device."""
