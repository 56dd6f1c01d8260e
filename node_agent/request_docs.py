"""What each field of the node's OpenAI request bodies means, for its OpenAPI schema
(/openapi.json): one table by model and JSON property name, which `describe` (every request
model's `json_schema_extra`) writes into the model's schema. A property whose `Field` carries a
description of its own keeps it; a model inherits its bases' entries.
"""

from __future__ import annotations

from pydantic.json_schema import JsonDict

_SAMPLING = {
    "model": "The served model's name.",
    "stream": "Answer as server-sent events, one chunk per piece of output, ending `[DONE]`.",
    "stream_options": "With `stream` only: `include_usage` adds a last chunk with the usage.",
    "temperature": "Sampling temperature in [0, 2]; 0 is greedy. Absent: 1.",
    "top_p": "Nucleus sampling: sample among the likeliest tokens whose mass reaches this.",
    "top_k": "Sample among this many likeliest tokens (vLLM's); 0 or -1: all.",
    "stop": "A string or up to 16 strings; the output ends before the first one it writes.",
    "seed": "Seeded sampling; choice i of `n` samples with `seed + i`.",
    "user": "The end user's id, as OpenAI takes it; not used by this node.",
    "ignore_eos": "Go on past the end-of-sequence token, up to the output limit (vLLM's).",
    "frequency_penalty": (
        "In [-2, 2]: subtracted from a token's logit once for each time it already occurs in "
        "the output."
    ),
    "presence_penalty": "In [-2, 2]: subtracted from the logit of a token the output has.",
    "repetition_penalty": (
        "vLLM's: the logits of tokens in the prompt or output are divided by it where positive, "
        "multiplied where negative; 1 or absent: off."
    ),
    "min_tokens": "Stop tokens and end-of-sequence are masked until this many tokens are out.",
    "stop_token_ids": "Token ids that end the output when sampled (vLLM's).",
    "guided_regex": (
        "vLLM's: the output matches this regular expression (constrained decoding). At most "
        "one of response_format (json), guided_regex and guided_choice."
    ),
    "guided_choice": "vLLM's: the output is exactly one of these strings (at most 256).",
    "cache_salt": (
        "vLLM's: prefix-cache hits only among requests of the same salt (1-1024 characters), "
        "combined with the gateway's per-tenant salt header."
    ),
    "return_token_ids": (
        "Each choice (and stream chunk) carries `token_ids`, its output's ids, and the first "
        "chunk `prompt_token_ids`: what a gateway resumes a broken stream from."
    ),
}
_CHAT = {
    "messages": "The conversation: system/developer, user, assistant (with its tool_calls) "
    "and tool (a result, with the tool_call_id it answers) messages.",
    "logprobs": "Return each output token's log probability.",
    "top_logprobs": "With logprobs: this many likeliest alternatives per token (0-20).",
    "tools": (
        "Functions the model may call (unique names). Rendered into the prompt by the model's "
        "template, or a generic tools section when it has none."
    ),
    "tool_choice": (
        "none (tools not shown), auto (the model decides; calls parsed from its output), "
        "required (one call, its arguments constrained by that function's schema) or "
        '{"type": "function", "function": {"name": ...}} (a call of that function).'
    ),
    "parallel_tool_calls": "false: the output ends after its first tool call.",
    "functions": "OpenAI's legacy function calling: refused, send `tools`.",
    "response_format": (
        "text, json_object (any JSON object) or json_schema (JSON that validates against the "
        "schema): enforced by constrained decoding, greedy or sampled."
    ),
}
_COMPLETION = {
    "prompt": "A string, token ids, or an array of one of either (one prompt per request).",
    "logprobs": "Return this many likeliest alternatives per output token (0-20).",
    "echo": "Refused: not supported.",
    "suffix": "Refused: not supported.",
    "best_of": "Only 1 (or absent).",
}
_FUNCTION = {
    "name": "The function's name: letters, digits, '_' or '-', at most 64.",
    "description": "What the function does, shown to the model.",
    "parameters": "The arguments' JSON schema; absent: a function of no arguments.",
    "strict": "Accepted; arguments are constrained exactly whenever they are constrained.",
}
FIELD_DOCS: dict[str, dict[str, str]] = {
    "SamplingRequest": _SAMPLING,
    "ChatCompletionRequest": _CHAT,
    "CompletionRequest": _COMPLETION,
    "StreamOptions": {"include_usage": "Send a last chunk with the usage and no choices."},
    "TextPart": {"type": "Only text parts are accepted.", "text": "The part's text."},
    "ChatMessageIn": {
        "role": "system, developer (taken as system), user, assistant or tool.",
        "content": "The text, or an array of text parts; null for an assistant's tool calls.",
        "name": "The speaker's name, passed to the template.",
        "tool_calls": "An assistant message's calls, as the model made them.",
        "tool_call_id": "A tool message's: the id of the call it answers.",
    },
    "ToolDefinition": {
        "type": "Only 'function'.",
        "function": "The function: its name, description and parameters' schema.",
    },
    "FunctionDefinition": _FUNCTION,
    "NamedToolChoice": {"type": "Only 'function'.", "function": "The function to call."},
    "FunctionRef": {"name": "A function named in `tools`."},
    "ToolCallIn": {
        "id": "The call's id, which a tool message's tool_call_id names.",
        "type": "Only 'function'.",
        "function": "The function called and its arguments.",
    },
    "FunctionCallIn": {
        "name": "The function called.",
        "arguments": "Its arguments, JSON text as the model wrote them.",
    },
    "ResponseFormat": {
        "type": "text (free), json_object or json_schema.",
        "json_schema": "With type json_schema only: the schema and its name.",
    },
    "JsonSchemaFormat": {
        "name": "The schema's name (1-64 characters).",
        "description": "What the output is for; not shown to the model.",
        "schema": "The JSON schema the output validates against.",
        "strict": "Accepted; the output follows the schema either way.",
    },
}


def describe(schema: JsonDict, model: type) -> None:
    """Fill in the descriptions `FIELD_DOCS` holds for `model`'s properties."""
    properties = schema.get("properties")
    if not isinstance(properties, dict):
        return
    for cls in model.__mro__:
        for name, text in FIELD_DOCS.get(cls.__name__, {}).items():
            field = properties.get(name)
            if isinstance(field, dict):
                field.setdefault("description", text)
