"""Command line for a person: `python -m engine pull|kernels|generate|chat`."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Iterator

from engine.config import EngineConfig
from engine.errors import EngineError
from engine.kernels import cpu_kernels
from engine.llm_engine import LLMEngine
from engine.model_store import DEFAULT_MODEL, pull
from engine.sampling_params import RequestOutputKind, SamplingParams
from engine.tokenizer import ChatMessage


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    try:
        if args.command == "pull":
            pull(args.name)
        elif args.command == "kernels":
            return _kernels(args.device)
        elif args.command == "generate":
            _generate(args)
        else:
            _chat(args)
    except (EngineError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m engine", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true", help="log at INFO")
    commands = parser.add_subparsers(dest="command", required=True)
    pull_cmd = commands.add_parser("pull", help="fetch a known model into the model cache")
    pull_cmd.add_argument("name", nargs="?", default=DEFAULT_MODEL)
    kernels_cmd = commands.add_parser(
        "kernels", help="build this CPU's native kernels now (else the first engine start does)"
    )
    kernels_cmd.add_argument("--device", default="auto")
    for name, text in (("generate", "continue one prompt"), ("chat", "talk with the model")):
        cmd = commands.add_parser(name, help=text)
        cmd.add_argument("--model", default=DEFAULT_MODEL, help="a pulled name or a path")
        cmd.add_argument("--dtype", default="auto")
        cmd.add_argument("--quantization", choices=["auto", "none", "int8", "q4_1"], default="auto")
        cmd.add_argument("--device", default="auto")
        cmd.add_argument("--max-tokens", type=int, default=256)
        cmd.add_argument("--temperature", type=float, default=0.7)
        cmd.add_argument("--top-p", type=float, default=0.9)
        cmd.add_argument("--seed", type=int, default=None)
    commands.choices["generate"].add_argument("--prompt", required=True)
    commands.choices["generate"].add_argument(
        "--chat", action="store_true", help="wrap the prompt in the model's chat template"
    )
    commands.choices["chat"].add_argument("--system", default=None, help="a system prompt")
    return parser


def _kernels(device: str) -> int:
    if EngineConfig(model="", device=device).torch_device().type != "cpu":
        print("not a CPU device: the CPU kernels are not used there")
        return 0
    module = cpu_kernels()
    if module is None:
        print(
            "CPU kernels off (MERIDIAN_CPU_KERNELS=0) or unavailable (the warning above): "
            "the engine uses PyTorch ops"
        )
        return 1
    print(f"CPU kernels ready: {module.__file__}")
    return 0


def _engine(args: argparse.Namespace) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model=args.model,
            dtype=args.dtype,
            quantization=args.quantization,
            device=args.device,
            cpu_kv_cache_gib=0.5,
        )
    )


def _params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        max_tokens=args.max_tokens,
        output_kind=RequestOutputKind.DELTA,
    )


def _stream(engine: LLMEngine, prompt: str, params: SamplingParams) -> Iterator[str]:
    engine.add_request("cli", prompt, params)
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                yield output.outputs[0].text
    finally:
        engine.abort_request(["cli"])


def _generate(args: argparse.Namespace) -> None:
    engine = _engine(args)
    prompt = args.prompt
    if args.chat:
        prompt = engine.tokenizer.render_chat([{"role": "user", "content": prompt}])
    for text in _stream(engine, prompt, _params(args)):
        print(text, end="", flush=True)
    print()


def _chat(args: argparse.Namespace) -> None:
    engine = _engine(args)
    messages: list[ChatMessage] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print(f"Chatting with {args.model}. An empty line or Ctrl-D ends the chat.", file=sys.stderr)
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if not line:
            break
        messages.append({"role": "user", "content": line})
        prompt = engine.tokenizer.render_chat(messages)
        reply = ""
        for text in _stream(engine, prompt, _params(args)):
            reply += text
            print(text, end="", flush=True)
        print()
        messages.append({"role": "assistant", "content": reply})


if __name__ == "__main__":
    sys.exit(main())
