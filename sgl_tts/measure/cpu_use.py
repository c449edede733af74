"""Machine-wide CPU use over a stretch of work, from the kernel's counters (`/proc/stat` through psutil).

The runtimes are servers in their own process groups, not children a `time` of the client could count, so a
run's CPU use is read machine-wide: busy time (everything but idle and I/O wait) over wall time, as a percentage
of one core (200% is all of a 2-core machine).
"""

from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuUse:
    busy_s: float  # CPU seconds spent on anything but idling, summed over the cores
    wall_s: float
    cores: int

    @property
    def percent(self) -> float:
        """Busy time as a percentage of one core: 0 to 100 × cores."""
        return 100 * self.busy_s / self.wall_s if self.wall_s > 0 else 0.0

    def describe(self) -> str:
        return f"CPU busy {self.percent:.0f}% of {100 * self.cores}% ({self.cores} cores) over {self.wall_s:.0f} s"


def busy_seconds() -> float:
    """CPU seconds the machine has spent busy since boot: user, nice, system and interrupts (not idle, I/O wait or
    time the hypervisor stole; guest time is already inside user)."""
    import psutil

    times = psutil.cpu_times()
    return sum(getattr(times, name, 0.0) for name in ("user", "nice", "system", "irq", "softirq"))


class CpuMeter:
    """`with CpuMeter() as meter: ...`, then `meter.use` (a CpuUse of the block)."""

    def __enter__(self) -> "CpuMeter":
        import psutil

        self.cores = psutil.cpu_count() or 1
        self._busy = busy_seconds()
        self._began = time.monotonic()
        self.use: CpuUse | None = None
        return self

    def __exit__(self, *exc: object) -> None:
        self.use = CpuUse(busy_seconds() - self._busy, time.monotonic() - self._began, self.cores)
