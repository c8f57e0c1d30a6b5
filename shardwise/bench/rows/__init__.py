"""Benchmark rows, one module per strategy family; each module defines ``ROWS: list[Row]``."""
