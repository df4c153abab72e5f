"""When to add or remove verifier replicas: a pure rule over the sessions the replicas hold, with an
injectable clock.

The fleet wants ceil(sessions / target_sessions) replicas, within [min, max]. A change waits until the want
has held for `up_delay_s` (growing) or `down_delay_s` (shrinking), so that a burst or a lull shorter than
that does not start or drain a replica (loading a model takes seconds; a drain moves live sessions).
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass
class Autoscaler:
    min_replicas: int = 1
    max_replicas: int = 4
    target_sessions: float = 8.0  # per replica
    up_delay_s: float = 10.0
    down_delay_s: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 1 <= min_replicas <= max_replicas, got {self.min_replicas}, {self.max_replicas}")
        if self.target_sessions <= 0:
            raise ValueError(f"target_sessions must be > 0, got {self.target_sessions}")
        self._since: float | None = None  # when the want first differed from the current count, this way
        self._direction = 0

    def desired(self, current: int, sessions: int, now: float) -> int:
        """The replica count to have now, given `current` replicas holding `sessions` sessions."""
        want = min(self.max_replicas, max(self.min_replicas, math.ceil(sessions / self.target_sessions)))
        direction = (want > current) - (want < current)
        if direction == 0:
            self._since, self._direction = None, 0
            return current
        if direction != self._direction:
            self._since, self._direction = now, direction
        delay = self.up_delay_s if direction > 0 else self.down_delay_s
        if now - self._since >= delay:
            self._since, self._direction = None, 0
            return want
        return current
