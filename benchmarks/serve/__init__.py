"""The HTTP benchmark (`make bench`): `python -m benchmarks.serve --help`."""
