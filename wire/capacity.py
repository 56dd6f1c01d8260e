"""Numbers a node's capacity report is defined by, shared by the nodes that make it and the
code that models them (the simulator), so that neither side keeps a copy.
"""

from __future__ import annotations

from typing import Final

# A heartbeat's `decode_tokens_per_s` is the tokens generated in the last this-many seconds,
# divided by it (engine/llm_engine.py measures it).
DECODE_RATE_WINDOW_S: Final = 10.0

# A node agent answers 429 once this many admitted requests have no first token yet (the
# default of its `max_num_waiting_requests`).
DEFAULT_MAX_NUM_WAITING_REQUESTS: Final = 256
