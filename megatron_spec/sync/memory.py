"""Peak extra memory of a block of code (what a weight sync adds on top of the model).

On CUDA: ``torch.cuda.max_memory_allocated`` after resetting the peak. On Linux CPU: the
process's peak resident set (``VmHWM``, which counts shared-memory pages it touched),
reset through ``/proc/self/clear_refs``. Elsewhere the measurement is unavailable (None),
never guessed.

It measures this process only (an engine process's memory is its own).
"""

from __future__ import annotations

import re

import torch

_STATUS = "/proc/self/status"


def _status_kib(field: str) -> int:
    with open(_STATUS) as f:
        m = re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.MULTILINE)
    if m is None:
        raise OSError(f"{field} missing from {_STATUS}")
    return int(m.group(1))


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS
        return True
    except OSError:
        return False


class PeakMemory:
    """``with PeakMemory(device) as pm: ...`` then ``pm.peak_extra_bytes`` (None if unavailable)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_extra_bytes: int | None = None
        self._base = 0
        self._ok = False

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._base = torch.cuda.memory_allocated(self.device)
            self._ok = True
        else:
            self._ok = _reset_cpu_peak()
            if self._ok:
                self._base = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc) -> None:
        if not self._ok:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_kib("VmHWM") * 1024
        self.peak_extra_bytes = max(0, peak - self._base)
