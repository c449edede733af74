"""Machine-wide CPU use over a block, from the kernel's counters."""

import time

import pytest

from sgl_tts.measure.cpu_use import CpuMeter, CpuUse


def test_percent_is_busy_time_over_wall_time_of_one_core():
    use = CpuUse(busy_s=3.0, wall_s=2.0, cores=2)
    assert use.percent == pytest.approx(150.0)
    assert use.describe().startswith("CPU busy 150% of 200% (2 cores)")
    assert CpuUse(1.0, 0.0, 2).percent == 0.0


def test_the_meter_counts_this_process_spinning():
    with CpuMeter() as meter:
        spent = time.process_time() + 0.3
        while time.process_time() < spent:  # 0.3 s of this process's CPU time, however fast the machine
            pass
    assert meter.use.busy_s >= 0.25  # the kernel counts in ticks (10 ms): 0.3 s of CPU less a tick or two
    assert meter.use.cores >= 1 and meter.use.wall_s > 0
