"""Runs the close-while-in-flight case of tests/test_adversarial_offload.py several times in this
process (JAX_PLATFORMS picks the backend), with faulthandler on, so a crash prints every thread's
Python stack. Usage: python3 -X faulthandler offload_close_stress.py [repeats] [rounds]"""

import faulthandler
import os
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
faulthandler.enable(all_threads=True)

from test_adversarial_offload import _close_mid_flight_cases  # noqa: E402

repeats = int(sys.argv[1]) if len(sys.argv) > 1 else 5
rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 6
for i in range(repeats):
  with tempfile.TemporaryDirectory() as d:
    print(i, _close_mid_flight_cases(os.path.join(d, "ssd"), rounds), flush=True)
