"""The engine's measured prefill rate: prompt tokens computed per second of the steps that
computed them, over the last steps that prefilled (a node reports it in its heartbeat, and the
gateways predict a request's prefill in its region by it).

Only computed tokens count: a prompt's prefix found in the cache costs nothing and is not in the
step's work. A step that also decodes is timed whole, so on a busy node the rate is the one a
prompt actually gets there (decodes share its steps), a little under the idle one. The ratio of
sums weighs each step by its time, so a few tiny prefills, mostly fixed cost, do not swamp the
long ones a prediction is about.
"""

from __future__ import annotations

from collections import deque
from typing import Final

# The last this-many steps that prefilled make the rate: enough to smooth one slow step (a page
# fault, a compile), few enough to follow a change of load within seconds.
PREFILL_RATE_STEPS: Final = 32


class PrefillRate:
    def __init__(self, num_steps: int = PREFILL_RATE_STEPS) -> None:
        self._steps: deque[tuple[int, float]] = deque(maxlen=num_steps)

    def record(self, num_prompt_tokens: int, seconds: float) -> None:
        """One step that computed `num_prompt_tokens` prompt tokens in `seconds` (a step with
        none, or timed at nothing, says nothing of the rate and is skipped)."""
        if num_prompt_tokens > 0 and seconds > 0.0:
            self._steps.append((num_prompt_tokens, seconds))

    @property
    def tokens_per_s(self) -> float | None:
        """None until a step has prefilled."""
        if not self._steps:
            return None
        return sum(n for n, _ in self._steps) / sum(s for _, s in self._steps)
