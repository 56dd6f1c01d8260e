"""Structured outputs and logit controls on the real model: constrained outputs always parse
and validate, free rows beside constrained and tool-call rows are the same as in that batch
unconstrained, penalties and bias act, a new grammar compiles while the batch steps on."""

from __future__ import annotations

import json
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import pytest
import torch
from pydantic import BaseModel, ConfigDict
from real_model import KV_CACHE_GIB

from engine import LLM, SamplingParams
from engine.chat_template import ChatMessage
from engine.config import EngineConfig
from engine.grammar import CompiledGrammar, GrammarCompiler, GrammarError, GrammarMatcher
from engine.grammar_spec import GrammarSpec
from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput
from engine.tool_prompt import TOOL_CALL_OPEN, with_tools

pytestmark = pytest.mark.slow


class City(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    country: str
    population: int
    is_capital: bool
    size: Literal["small", "medium", "large"]


SCHEMA = GrammarSpec("json_schema", json.dumps(City.model_json_schema()))
PROMPTS = [
    "Describe Paris as JSON.",
    "Give me a JSON object about Tokyo.",
    "Tell me about a small town in Norway, in JSON.",
    "What is the largest city in Brazil? Answer in JSON.",
]


def chat(text: str) -> list[ChatMessage]:
    return [{"role": "user", "content": text}]


@pytest.fixture(scope="module")
def llm(smollm2_gguf: Path) -> LLM:
    return LLM(str(smollm2_gguf), max_model_len=512, cpu_kv_cache_gib=KV_CACHE_GIB)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_schema_constrained_outputs_parse_and_validate(llm: LLM, temperature: float) -> None:
    params = [
        SamplingParams(temperature=temperature, seed=i, max_tokens=200, grammar=SCHEMA)
        for i in range(len(PROMPTS))
    ]
    outs = llm.chat([chat(p) for p in PROMPTS], params)
    for out in outs:
        completion = out.outputs[0]
        assert completion.finish_reason == "stop", completion.text
        City.model_validate_json(completion.text)


def test_json_object_regex_and_choice(llm: LLM) -> None:
    greedy = {"temperature": 0.0, "max_tokens": 100}
    specs = [
        GrammarSpec("json_object"),
        GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"),
        GrammarSpec("choice", json.dumps(["yes", "no", "maybe"])),
    ]
    prompt = chat("Is the sky blue?")
    outs = llm.chat([prompt] * 3, [SamplingParams(**greedy, grammar=s) for s in specs])  # type: ignore[arg-type]
    texts = [o.outputs[0].text for o in outs]
    assert isinstance(json.loads(texts[0]), dict)
    assert len(texts[1]) == 6 and texts[1][:3].isdigit() and texts[1][3] == "-"
    assert texts[2] in ("yes", "no", "maybe")
    assert all(o.outputs[0].finish_reason == "stop" for o in outs)


def test_a_cut_off_constrained_output_finishes_with_length(llm: LLM) -> None:
    [out] = llm.chat(chat(PROMPTS[0]), SamplingParams(temperature=0, max_tokens=5, grammar=SCHEMA))
    assert out.outputs[0].finish_reason == "length"
    assert out.outputs[0].text.startswith("{")


WEATHER_CALL = {  # a required call of one tool, as node_agent/tool_plan.py constrains it
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 30}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


def tool_prompt(llm: LLM) -> str:
    """A question with the weather tool rendered, ending where a required call starts."""
    arguments = WEATHER_CALL["properties"]["arguments"]  # type: ignore[index]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": arguments}}
    messages = with_tools(chat("What is the weather in Paris?"), [tool])
    return llm.get_tokenizer().render_chat(messages) + TOOL_CALL_OPEN


def test_free_rows_beside_constrained_ones_equal_the_same_batch_unconstrained(llm: LLM) -> None:
    """The grammars change their own rows only. Compared with the same batch whose other rows
    are free: a step's size picks the matmul path (up to 16 tokens the Q4_1 kernel, above it
    the dequantized weights, engine/model/block_weights.py), whose sums differ in order, so
    only a batch of the same shape at every step may be asked for the same bits. The free rows
    stop first (12 tokens; each JSON takes more), and the grammars are compiled before, so that
    no constrained row waits outside the scheduler and starts in a later step."""
    free = [SamplingParams(temperature=0, max_tokens=12), SamplingParams(seed=7, max_tokens=12)]
    call = GrammarSpec("json_schema", json.dumps(WEATHER_CALL))
    constrained = [
        SamplingParams(temperature=0, max_tokens=60, grammar=SCHEMA),
        SamplingParams(temperature=0, max_tokens=40, grammar=call),
    ]
    unconstrained = [replace(p, grammar=None, ignore_eos=True) for p in constrained]
    tokenizer = llm.get_tokenizer()
    prompts = [
        tokenizer.render_chat(chat(PROMPTS[0])),
        tokenizer.render_chat(chat(PROMPTS[2])),
        tool_prompt(llm),
        tokenizer.render_chat(chat(PROMPTS[1])),
    ]
    for spec in (SCHEMA, call):
        llm.engine.grammars.compile(spec).result()
    # Once first, so that both batches below find the same blocks cached.
    llm.generate(prompts, [free[0], *unconstrained, free[1]])
    unmixed = llm.generate(prompts, [free[0], *unconstrained, free[1]])
    mixed = llm.generate(prompts, [free[0], *constrained, free[1]])
    assert [mixed[i].outputs[0].token_ids for i in (0, 3)] == [
        unmixed[i].outputs[0].token_ids for i in (0, 3)
    ]
    assert all(len(mixed[i].outputs[0].token_ids) > 12 for i in (1, 2))
    City.model_validate_json(mixed[1].outputs[0].text)
    assert json.loads(mixed[2].outputs[0].text)["name"] == "get_weather"


def test_frequency_penalty_changes_a_repeating_greedy_output(llm: LLM) -> None:
    prompt = chat("Repeat the word 'apple' fifty times.")
    [plain] = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=40))
    [penalized] = llm.chat(
        prompt, SamplingParams(temperature=0, max_tokens=40, frequency_penalty=1.5)
    )
    assert plain.outputs[0].text.count("apple") > penalized.outputs[0].text.count("apple")


def test_logit_bias_forces_and_forbids_a_token(llm: LLM) -> None:
    prompt = chat("Say hello.")
    [plain] = llm.chat(prompt, SamplingParams(temperature=0, max_tokens=4))
    first = plain.outputs[0].token_ids[0]
    [forbidden] = llm.chat(
        prompt, SamplingParams(temperature=0, max_tokens=4, logit_bias={first: -100.0})
    )
    assert first not in forbidden.outputs[0].token_ids
    forced_id = llm.get_tokenizer().encode(" banana")[0]
    [forced] = llm.chat(
        prompt, SamplingParams(temperature=0, max_tokens=3, logit_bias={forced_id: 100.0})
    )
    assert forced.outputs[0].token_ids == [forced_id] * 3


def test_logprobs_still_come_with_controls_and_grammar(llm: LLM) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=20, logprobs=2, presence_penalty=0.5, grammar=SCHEMA
    )
    [out] = llm.chat(chat(PROMPTS[0]), params)
    completion = out.outputs[0]
    assert completion.logprobs is not None
    assert len(completion.logprobs) == len(completion.token_ids)
    assert all(len(lp.top) == 2 for lp in completion.logprobs)


def test_an_abort_while_the_grammar_compiles_and_the_engine_goes_on(llm: LLM) -> None:
    engine = llm.engine
    schema = {"type": "object", "properties": {"fresh": {"type": "integer"}}}
    params = SamplingParams(max_tokens=8, grammar=GrammarSpec("json_schema", json.dumps(schema)))
    engine.add_request("compiling", "Hi", params)
    [aborted] = engine.abort_request(["compiling"])
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert not engine.has_unfinished_requests()
    [ok] = llm.chat(chat("Hi"), SamplingParams(temperature=0, max_tokens=4, min_tokens=4))
    assert len(ok.outputs[0].token_ids) == 4


class FailingMatcher(GrammarMatcher):
    """A matcher that fails on the next token, as a grammar error mid-sequence would."""

    def __init__(self, inner: GrammarMatcher):
        self.inner = inner

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self.inner.fill_bitmask(bitmask, row)

    def accept(self, token_id: int) -> None:
        raise GrammarError("grammar error: injected")


def test_a_grammar_error_ends_its_sequence_and_the_batch_goes_on(llm: LLM) -> None:
    engine = llm.engine
    free = SamplingParams(temperature=0, max_tokens=16)
    [alone] = llm.chat(chat(PROMPTS[1]), free)
    prompt = engine.tokenizer.render_chat(chat(PROMPTS[0]), add_generation_prompt=True)
    free_prompt = engine.tokenizer.render_chat(chat(PROMPTS[1]), add_generation_prompt=True)
    engine.add_request("failing", prompt, SamplingParams(max_tokens=40, grammar=SCHEMA))
    engine.add_request("free", free_prompt, free)
    finished = {}
    while engine.has_unfinished_requests():
        state = engine.requests.get("failing")
        if state is not None and state.seq.num_output_tokens == 2:
            assert state.seq.grammar is not None
            state.seq.grammar = FailingMatcher(state.seq.grammar)
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0]
    failed = finished["failing"]
    assert failed.finish_reason == "error" and "injected" in str(failed.stop_reason)
    assert finished["free"].token_ids == alone.outputs[0].token_ids


def test_a_resumed_constrained_generation_goes_on_under_the_same_grammar(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=60, grammar=SCHEMA)
    [whole] = llm.chat(chat(PROMPTS[0]), params)
    ids = whole.outputs[0].token_ids
    prompt = engine.tokenizer.render_chat(chat(PROMPTS[0]), add_generation_prompt=True)
    engine.add_request("resumed", prompt, params, resumed_token_ids=ids[:6])
    outputs = []
    while engine.has_unfinished_requests():
        outputs += [o for o in engine.step() if o.finished]
    [resumed] = outputs
    assert ids[:6] + resumed.outputs[0].token_ids[6:] == ids
    City.model_validate_json(resumed.outputs[0].text)


class HeldCompiler(GrammarCompiler):
    """Compiles a grammar only once `release` is set (an error if never, not a hang)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.release = threading.Event()

    def _compile(self, spec: GrammarSpec) -> CompiledGrammar:
        if not self.release.wait(timeout=120):
            raise GrammarError("the test never released the compile")
        return super()._compile(spec)


def test_the_batch_steps_on_while_a_new_grammar_compiles(smollm2_gguf: Path) -> None:
    config = EngineConfig(model=str(smollm2_gguf), max_model_len=512, cpu_kv_cache_gib=KV_CACHE_GIB)
    engine = LLMEngine(config, grammar_compiler=HeldCompiler)
    try:
        compiler = engine.grammars
        assert isinstance(compiler, HeldCompiler)
        prompt = engine.tokenizer.render_chat(chat(PROMPTS[0]), add_generation_prompt=True)
        free = SamplingParams(temperature=0, max_tokens=8, min_tokens=8)
        engine.add_request("free", prompt, free)
        held_params = SamplingParams(temperature=0, max_tokens=60, grammar=SCHEMA)
        engine.add_request("held", prompt, held_params)
        outputs: list[RequestOutput] = []
        while not any(o.request_id == "free" and o.finished for o in outputs):
            outputs += engine.step()
        # The free request ran to its end while the other's grammar was still compiling.
        assert len(next(o for o in outputs if o.finished).outputs[0].token_ids) == 8
        assert [o.request_id for o in outputs if o.request_id == "held"] == []
        assert engine.requests["held"].seq.num_output_tokens == 0
        compiler.release.set()
        while engine.has_unfinished_requests():
            outputs += engine.step()
        (held,) = [o for o in outputs if o.request_id == "held" and o.finished]
        assert held.outputs[0].finish_reason == "stop"
        City.model_validate_json(held.outputs[0].text)
    finally:
        compiler.release.set()
        engine.shutdown()


def test_a_grammar_no_token_can_start_fails_its_compile(llm: LLM) -> None:
    compiler = llm.engine.grammars
    nothing = GrammarSpec("regex", r"[^\x00-\U0010FFFF]")  # a class of no character
    nothing.check()  # well formed: only the vocabulary tells
    with pytest.raises(GrammarError, match="guided_regex: no output of it can be spelled"):
        compiler.compile(nothing).result()
    compiler.compile(GrammarSpec("regex", "")).result()  # the empty output is one
