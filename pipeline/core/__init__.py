"""What every wing shares: config, storage, errors, logs, capacity, figures, fault points."""
