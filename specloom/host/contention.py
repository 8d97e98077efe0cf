"""How much of this machine other processes used while we timed something: the check that keeps a measurement
taken beside other work out of the per-host caches.

A timing taken while another process shares the cores is not this host's own, and the caches keep it for good. The
fastest of several repeats does not clean it: with a data generator on one of two cores, every pass of the verify-
cost curve ran ~2.5x slower and the curve came out flat (a 5-token pass at 1.16 decode steps where the quiet host
shows 1.51), so every later run drafted as if verification were nearly free. Linux's /proc/stat counts every CPU's
busy time; less our own process's CPU time, the rest is other work (steal time included: a VM's host busy).

    watch = Contention()          # before timing
    ...                           # the timing
    share = watch.others()        # other work's share of all CPUs since, or None where it cannot be told

Imports: the standard library only.
"""

from __future__ import annotations

import os
import time

BUSY_SHARE = 0.2  # other processes used more than this share of all CPUs: the timing is not this host's own
MIN_WALL_S = 0.5  # shorter windows are below /proc/stat's resolution (10 ms ticks): not judged


def _busy_seconds() -> float | None:
    """Seconds of CPU time all CPUs have spent busy since boot (user, nice, system, irq, softirq, steal)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
        if fields[0] != "cpu":
            return None
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def _own_seconds() -> float:
    t = os.times()
    return t.user + t.system


class Contention:
    """Other processes' share of the machine's CPUs between construction and `others()`."""

    def __init__(self):
        self.busy, self.own, self.wall = _busy_seconds(), _own_seconds(), time.monotonic()

    def others(self) -> float | None:
        """Other work's share of all CPUs (0 = none, 1 = every CPU busy with it) since this was made; None where
        /proc/stat cannot be read or the window is too short to judge."""
        busy, wall = _busy_seconds(), time.monotonic() - self.wall
        if busy is None or self.busy is None or wall < MIN_WALL_S:
            return None
        cpus = os.cpu_count() or 1
        return max(0.0, (busy - self.busy) - (_own_seconds() - self.own)) / (wall * cpus)

    def busy_host(self) -> str:
        """"" when the window looks quiet (or cannot be judged); else a short description of the other work."""
        share = self.others()
        if share is None or share <= BUSY_SHARE:
            return ""
        return f"other processes used {share:.0%} of the CPUs meanwhile"
