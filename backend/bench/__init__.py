"""Benchmarks (run by ``hybridmoe bench ...``, never by pytest): timed runs print ratios
against the memory-bandwidth limit and against reference systems measured in the same run."""
