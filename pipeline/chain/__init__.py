"""The chain's client: the jobs planned, submitted in order with Ray's job SDK and followed to
their end, their progress reported; what `python -m jobs.submit` runs, never a job itself."""
