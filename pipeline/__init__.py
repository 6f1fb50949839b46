"""Library behind the jobs in jobs/: configs, sources, transforms, dataset I/O, Ray runs."""
