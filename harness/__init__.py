"""Development harness: throwaway local Ray clusters for the demo, the tests and the benchmarks.

Not part of the installed library: nothing on a cluster imports it.
"""
