"""Side-by-side benchmarks: each compares jaxdata with the paths a JAX user has today, in one
run, on one machine, and writes a table to docs/benchmarks/. They live outside the package (the
wheel does not ship them): run them from a clone as `jaxdata bench NAME` after
`pip install -e ".[bench]"`, or as `PYTHONPATH=examples python3 -m benchmarks NAME`."""
