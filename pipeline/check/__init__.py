"""The cluster check: whether the bundle runs on a cluster, GPUs included, as a table of rows."""
