"""The request and response fields that let a gateway resume a stream in another region.

Both are extensions to OpenAI's bodies, in vLLM's spelling where vLLM has one:
- `return_token_ids: true` on a request: every stream chunk's choice (and a whole answer's
  choice) carries `token_ids`, the ids of the output it holds. A chunk is sent for every
  engine output that has ids, even one whose text is still held back. The first chunk (and a
  whole answer) also carries `prompt_token_ids` at the top level: what the node prefills, the
  prompt and then any resumed ids (the usage's `prompt_tokens`), so that a gateway knows the
  usage even if the stream breaks before its usage chunk.
- `resume_token_ids: [...]` on a request: output ids already generated (and delivered) by an
  earlier attempt of the same request. The node continues that generation after them, as if it
  had produced them itself: for chat, inside the same assistant message (no new generation
  prompt); seeded sampling goes on at their position; `max_tokens` counts new tokens only; the
  answer holds only what is new, and its usage counts the resumed ids as prompt (so does every
  limit on the prompt). It is the gateway's field alone: a gateway refuses it from clients, and
  a node takes it only with its serving token (a node without one refuses it).
A gateway marks the last chunk (with `finish_reason`) of a resumed stream, and a resumed whole
answer, with `meridian_resumes`: how many times it was continued elsewhere.
"""

from __future__ import annotations

from typing import Final

RETURN_TOKEN_IDS: Final = "return_token_ids"
RESUME_TOKEN_IDS: Final = "resume_token_ids"
TOKEN_IDS: Final = "token_ids"
PROMPT_TOKEN_IDS: Final = "prompt_token_ids"
RESUMES_FIELD: Final = "meridian_resumes"
