"""`python -m benchmarks NAME [options]` (with examples/ on PYTHONPATH) is `jaxdata bench NAME
[options]`, and `python -m benchmarks rok [options]` is `jaxdata rok`: the benchmarks run without
the command being installed."""

import sys

from jaxdata import cli

if __name__ == "__main__":
  argv = sys.argv[1:]
  sys.exit(cli.main(argv if argv[:1] == ["rok"] else ["bench", *argv]))
