"""The benchmarks' timing helpers: queued rounds, the wait they use, the queue depth they pick."""
import time

import pytest

from jaxdata.bench import common


class FakeDevice:
  """Calls that return at once and finish `seconds` later, like asynchronous dispatch: `wait`
  blocks until every call issued so far is done (one queue, as a GPU stream)."""

  def __init__(self, seconds: float):
    self.seconds = seconds
    self.done_at = 0.0
    self.calls = 0
    self.waits = 0

  def call(self):
    self.calls += 1
    self.done_at = max(self.done_at, time.perf_counter()) + self.seconds
    return self.calls

  def wait(self, result):
    self.waits += 1
    time.sleep(max(0.0, self.done_at - time.perf_counter()))
    return result


def test_queued_rounds_time_the_device_not_the_round_trip():
  dev = FakeDevice(0.004)
  # every call waited for alone pays a fixed host round trip on top
  alone = common.median_seconds(lambda: (time.sleep(0.002), dev.call())[1], warmup=1,
                                repeats=3, wait=dev.wait)
  queued = common.median_seconds(lambda: (time.sleep(0.0002), dev.call())[1], warmup=1,
                                 repeats=3, queued=10, wait=dev.wait)
  assert alone == pytest.approx(0.006, rel=0.3)
  assert queued == pytest.approx(0.004, rel=0.3)


def test_median_seconds_waits_once_per_round():
  dev = FakeDevice(0.0)
  common.median_seconds(dev.call, warmup=2, repeats=3, queued=5, wait=dev.wait)
  assert dev.calls == 2 + 3 * 5
  assert dev.waits == 2 + 3


@pytest.mark.parametrize("seconds,lo,hi", [(0.004, 3, 5), (0.03, 1, 1), (1e-5, 20, 20)])
def test_queue_depth_fills_about_twenty_milliseconds(seconds, lo, hi):
  dev = FakeDevice(seconds)
  assert lo <= common.queue_depth(dev.call, wait=dev.wait) <= hi


def test_step_seconds_gives_queued_and_alone():
  dev = FakeDevice(0.004)
  queued, alone = common.step_seconds(lambda: (time.sleep(0.002), dev.call())[1], repeats=3,
                                      wait=dev.wait)
  assert queued == pytest.approx(0.004, rel=0.3)
  assert alone == pytest.approx(0.006, rel=0.3)
