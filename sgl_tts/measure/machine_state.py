"""The machine's state beside a figure: load average, CPU frequency and temperature where the machine exposes them.

Sources, each read where it exists and said "not exposed" where it does not (a virtual machine often has no
cpufreq and no thermal zones):
- the load average (`os.getloadavg`);
- the CPU frequency the kernel reports per CPU in `/proc/cpuinfo` ("cpu MHz"), and the cpufreq driver's
  current frequency (`/sys/devices/system/cpu/cpu*/cpufreq/scaling_cur_freq`, kHz);
- temperatures from the thermal zones (`/sys/class/thermal/thermal_zone*/temp`, millidegrees, named by their
  `type`) and from `psutil.sensors_temperatures`.
Every reader takes its root, so tests give it a fake tree.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

PROC_CPUINFO = Path("/proc/cpuinfo")
SYS_CPU = Path("/sys/devices/system/cpu")
SYS_THERMAL = Path("/sys/class/thermal")
NOT_EXPOSED = "not exposed"


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def cpuinfo_mhz(cpuinfo: str) -> list[float]:
    """The "cpu MHz" of every CPU in a `/proc/cpuinfo` text."""
    return [float(m.group(1)) for m in re.finditer(r"^cpu MHz\s*:\s*([0-9.]+)\s*$", cpuinfo, re.M)]


def cpufreq_mhz(root: Path = SYS_CPU) -> list[float]:
    """The cpufreq driver's current frequency of every CPU that has one, in MHz (the files hold kHz)."""
    values = []
    for path in sorted(root.glob("cpu[0-9]*/cpufreq/scaling_cur_freq"), key=lambda p: int(p.parts[-3][3:])):
        text = _read(path)
        if text is not None and text.strip().isdigit():
            values.append(int(text) / 1000)
    return values


def thermal_zones_c(root: Path = SYS_THERMAL) -> dict[str, float]:
    """Each thermal zone's temperature in °C, keyed `type` (or the zone's folder name without one); a zone whose
    reading fails or is not a number is left out."""
    zones = {}
    for zone in sorted(root.glob("thermal_zone*")):
        text = _read(zone / "temp")
        if text is None or not re.fullmatch(r"-?\d+", text.strip()):
            continue
        name = (_read(zone / "type") or zone.name).strip() or zone.name
        zones[name if name not in zones else f"{name} ({zone.name})"] = int(text) / 1000
    return zones


def sensor_temperatures_c() -> dict[str, float]:
    """psutil's temperature sensors, `chip/label` -> °C (empty where psutil has none on this platform)."""
    import psutil

    reader = getattr(psutil, "sensors_temperatures", None)
    try:
        readings = reader() if reader is not None else {}
    except (OSError, RuntimeError):
        return {}
    return {f"{chip}/{entry.label or index}": float(entry.current)
            for chip, entries in readings.items() for index, entry in enumerate(entries)}


@dataclass(frozen=True)
class MachineState:
    load: tuple[float, float, float]
    cpuinfo_mhz: list[float] = field(default_factory=list)
    cpufreq_mhz: list[float] = field(default_factory=list)
    temperatures_c: dict[str, float] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: 'load 0.16/0.04/0.10; 2596 MHz (cpuinfo, 2 CPUs), cpufreq not exposed; temperature not
        exposed'."""
        parts = [f"load {self.load[0]:.2f}/{self.load[1]:.2f}/{self.load[2]:.2f}"]
        parts.append(f"{frequency_text(self.cpuinfo_mhz, 'cpuinfo')}, {frequency_text(self.cpufreq_mhz, 'cpufreq')}")
        parts.append(("temperature " + ", ".join(f"{name} {value:.0f} C" for name, value in
                                                 self.temperatures_c.items()))
                     if self.temperatures_c else f"temperature {NOT_EXPOSED}")
        return "; ".join(parts)

    def as_dict(self) -> dict:
        return {"load": list(self.load), "cpuinfo_mhz": self.cpuinfo_mhz, "cpufreq_mhz": self.cpufreq_mhz,
                "temperatures_c": self.temperatures_c}


def frequency_text(mhz: list[float], source: str) -> str:
    """'2596 MHz (cpuinfo, 2 CPUs)', a range where the CPUs differ, or '<source> not exposed'."""
    if not mhz:
        return f"{source} {NOT_EXPOSED}"
    low, high = min(mhz), max(mhz)
    value = f"{low:.0f} MHz" if round(low) == round(high) else f"{low:.0f}-{high:.0f} MHz"
    return f"{value} ({source}, {len(mhz)} CPUs)"


def read_machine_state(cpuinfo: Path = PROC_CPUINFO, sys_cpu: Path = SYS_CPU, sys_thermal: Path = SYS_THERMAL,
                       sensors: Callable[[], dict[str, float]] = sensor_temperatures_c,
                       load: Callable[[], tuple[float, float, float]] = os.getloadavg) -> MachineState:
    """The state now (see the module docstring); the thermal zones' readings first, psutil's sensors beside them."""
    temperatures = thermal_zones_c(sys_thermal)
    for name, value in sensors().items():
        temperatures.setdefault(name, value)
    return MachineState(tuple(load()), cpuinfo_mhz(_read(cpuinfo) or ""), cpufreq_mhz(sys_cpu), temperatures)
