"""The training input: stored Parquet shards into training batches (docs/layout.md)."""
