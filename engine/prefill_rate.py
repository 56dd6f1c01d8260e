"""The engine's measured prefill rate: prompt tokens computed per second that computing them
added to the steps, over the last steps that prefilled (a node reports it in its heartbeat, and
the gateways predict a request's prefill in its region by it), and the fixed part of a step
(the region's picker counts a step of it for each request ahead of a new one).

A step costs a fixed part (the decodes it carries, the launch and sampling) plus its prompt
tokens at the rate. The fixed part is the mean time of the last steps that computed no prompt
token, and comes off each prefilling step's time: timed whole, short prompts on a busy node made
the rate a tenth of the marginal one, and the gateways, charging a prompt's tokens at it, saw a
region that had served a few short prompts as seconds slower than one that had served none.
Only computed tokens count: a prompt's prefix found in the cache is not in the step's work.
"""

from __future__ import annotations

from collections import deque
from statistics import fmean
from typing import Final

# The last this-many steps of each kind make the rate: enough to smooth one slow step (a page
# fault, a compile), few enough to follow a change of load within seconds.
PREFILL_RATE_STEPS: Final = 32
# A floor on what a prompt token adds (one a million a second, far past any node): steps whose
# prefill hid in the noise of the fixed part would otherwise make the rate unbounded.
MIN_TOKEN_S: Final = 1e-6


class PrefillRate:
    def __init__(self, num_steps: int = PREFILL_RATE_STEPS) -> None:
        self._prefills: deque[tuple[int, float]] = deque(maxlen=num_steps)
        self._others: deque[float] = deque(maxlen=num_steps)

    def record(self, num_prompt_tokens: int, seconds: float) -> None:
        """One step that computed `num_prompt_tokens` prompt tokens in `seconds` (a step timed
        at nothing says nothing and is skipped)."""
        if seconds <= 0.0:
            return
        if num_prompt_tokens > 0:
            self._prefills.append((num_prompt_tokens, seconds))
        else:
            self._others.append(seconds)

    @property
    def step_s(self) -> float | None:
        """The fixed part: the mean time of the last steps that computed no prompt token (None
        until one has run). It grows with the batch: each running sequence adds to a step."""
        return fmean(self._others) if self._others else None

    @property
    def tokens_per_s(self) -> float | None:
        """None until a step has prefilled."""
        if not self._prefills:
            return None
        fixed_s = self.step_s or 0.0
        num_tokens = sum(n for n, _ in self._prefills)
        added_s = sum(max(0.0, s - fixed_s) for _, s in self._prefills)
        return num_tokens / max(added_s, num_tokens * MIN_TOKEN_S)
