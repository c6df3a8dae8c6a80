"""Benchmarks behind `fedmq bench ...`; each module has a bench_* function, format_table and main."""
