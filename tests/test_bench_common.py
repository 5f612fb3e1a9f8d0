"""The benchmarks' timing helpers: queued rounds, the wait they use, the queue depth they pick.

Against a simulated asynchronous device on a virtual clock (`timing.time.perf_counter` is
patched), so the figures are exact and do not depend on how busy the machine running the tests
is.
"""

import types

import pytest

from jaxdata import timing


class FakeDevice:
  """Calls that cost the host `host` seconds and finish `seconds` of device time later, one
  queue (as a GPU stream); `wait` blocks until every call issued so far is done and then costs
  `wake` seconds (the host's round trip)."""

  def __init__(self, seconds: float, host: float = 0.0, wake: float = 0.0):
    self.seconds, self.host, self.wake = seconds, host, wake
    self.now = self.done_at = 0.0
    self.calls = self.waits = 0

  def call(self):
    self.calls += 1
    self.now += self.host
    self.done_at = max(self.done_at, self.now) + self.seconds
    return self.calls

  def wait(self, result):
    self.waits += 1
    self.now = max(self.now, self.done_at) + self.wake
    return result


@pytest.fixture
def device(monkeypatch):
  def make(*args, **kwargs):
    dev = FakeDevice(*args, **kwargs)
    monkeypatch.setattr(timing, "time", types.SimpleNamespace(perf_counter=lambda: dev.now))
    return dev

  return make


def test_queued_rounds_time_the_device_not_the_round_trip(device):
  dev = device(0.004, host=0.0002, wake=0.002)
  alone = timing.median_seconds(dev.call, warmup=1, repeats=3, wait=dev.wait)
  queued = timing.median_seconds(dev.call, warmup=1, repeats=3, queued=10, wait=dev.wait)
  assert alone == pytest.approx(0.0062)  # host + device + wake-up
  assert queued == pytest.approx(0.0042, rel=0.05)  # the device, plus a tenth of the wake-up


def test_median_seconds_waits_once_per_round(device):
  dev = device(0.0)
  timing.median_seconds(dev.call, warmup=2, repeats=3, queued=5, wait=dev.wait)
  assert dev.calls == 2 + 3 * 5
  assert dev.waits == 2 + 3


@pytest.mark.parametrize("seconds,want", [(0.004, 5), (0.03, 1), (1e-5, 20)])
def test_queue_depth_fills_about_twenty_milliseconds(device, seconds, want):
  dev = device(seconds)
  assert timing.queue_depth(dev.call, wait=dev.wait) == want


def test_step_seconds_gives_queued_and_alone(device):
  dev = device(0.004, host=0.0002, wake=0.002)
  queued, alone = timing.step_seconds(dev.call, repeats=3, wait=dev.wait)
  assert timing.queue_depth(dev.call, wait=dev.wait) == 3  # 20 ms / 6.2 ms
  assert queued == pytest.approx(0.004 + 0.002 / 3, rel=0.05)
  assert alone == pytest.approx(0.0062)
