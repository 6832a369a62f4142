"""Simulated environment time: how long a step (or an episode start) takes.

Real environments (a web shop backend, a household simulator, a GUI VM) answer in tens of
milliseconds to seconds with a long tail; the paper's workloads depend on that tail. A
:class:`LatencyModel` samples one duration per call from :class:`LatencyConfig`:

* ``none``: 0 seconds;
* ``fixed``: always ``median_s``;
* ``lognormal``: ``median_s * exp(sigma * N(0, 1))``, whose median is ``median_s``.

It only returns numbers; the caller decides whether to sleep (the server) or to advance a
simulated clock (the simulator).
"""

from __future__ import annotations

import math
import random

from tiderl.core.quote import short
from tiderl.env.config import LatencyConfig


class LatencyModel:
    def __init__(self, config: LatencyConfig, rng: random.Random):
        self.config = config
        self.rng = rng

    def sample(self) -> float:
        """One duration in seconds (>= 0)."""
        kind = self.config.kind
        if kind == "none":
            return 0.0
        if kind == "fixed":
            return self.config.median_s
        if kind == "lognormal":
            return self.config.median_s * math.exp(self.config.sigma * self.rng.gauss(0.0, 1.0))
        raise ValueError(f"kind: unknown latency kind {short(kind)}")
