"""Side-by-side benchmarks behind `jaxdata bench ...`: each compares jaxdata with the paths a JAX
user has today, in one run, on one machine, and writes a table to docs/benchmarks/."""
