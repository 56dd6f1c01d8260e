"""The stack YAML: the repository's default, partial files, and one-line errors for bad ones;
and the layout (ports, ingress chain) derived from it."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine.model_store import DEFAULT_MODEL
from stack.config import (
    DEFAULT_CONFIG,
    ControlPlaneConfig,
    StackConfig,
    load_config,
    parse_config,
)
from stack.errors import StackConfigError, StackError
from stack.layout import plan_layout
from wire.geo import REGIONS, locate, rtt_ms


def test_default_config_is_the_three_local_regions_and_a_second_model_in_one() -> None:
    config = load_config()
    fp32 = f"{DEFAULT_MODEL}-fp32"
    assert [(r.name, config.placement(r)) for r in config.regions] == [
        ("us-east", {DEFAULT_MODEL: 1}),
        ("eu-west", {DEFAULT_MODEL: 1, fp32: 1}),
        ("ap-southeast", {DEFAULT_MODEL: 1}),
    ]
    assert config.default_model.name == DEFAULT_MODEL
    assert [(m.served, m.weights, m.dtype, m.quantization) for m in config.fleet_models] == [
        (DEFAULT_MODEL, DEFAULT_MODEL, "auto", "auto"),
        (fp32, DEFAULT_MODEL, "fp32", "none"),
    ]
    assert config.aliases == {"chat-default": DEFAULT_MODEL}
    assert config.model_named(fp32).fallbacks == [DEFAULT_MODEL]
    assert config.pops == ["new-york", "london", "singapore"]
    assert config.clients == ["tokyo", "paris", "chicago"]
    assert config.limits == "shared" and config.edge is None
    assert config.dns_name == "api.meridian.test"
    assert config.envoy == "auto" and config.simulate_rtt
    assert config.ports.gateway == 8443 and config.ports.control_plane == 8080
    # Beyond the fleet itself, the YAML spells out every default: what a reader sees is what runs.
    assert config == StackConfig(
        regions=config.regions, models=config.models, model=config.model, aliases=config.aliases
    )


def test_a_partial_file_takes_defaults_for_the_rest() -> None:
    config = parse_config("regions: [{name: eu-west, nodes: 2}]\nenvoy: off\n")
    assert [(r.name, config.placement(r)) for r in config.regions] == [
        ("eu-west", {DEFAULT_MODEL: 2})
    ]
    assert config.envoy == "off"
    assert config.ports.node_base == 9001
    assert config.regions[0].location == (REGIONS["eu-west"].lat, REGIONS["eu-west"].lon)


def test_a_region_outside_the_table_needs_its_location() -> None:
    config = parse_config("regions: [{name: lab, lat: 10, lon: 20, rtt_ms: 7}]")
    assert config.regions[0].location == (10.0, 20.0)
    layout = plan_layout(config, use_envoy=False)
    assert layout.regions[0].rtt_ms == 7.0


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("regions: [{name: us-east}]\nmodle: x\n", "modle: Extra inputs are not permitted"),
        ("regions: []", "regions: List should have at least 1 item"),
        ("model: x", "regions: Field required"),
        ("regions: [{name: US_East}]", "regions.0.name: String should match pattern"),
        ("regions: [{name: lab}]", "region lab is not in wire/geo.py's table"),
        ("regions: [{name: lab, lat: 1}]", "give both lat and lon, or neither"),
        ("regions: [{name: us-east, nodes: 0}]", "regions.0.nodes: Input should be greater"),
        ("regions: [{name: us-east}, {name: us-east}]", "unique; repeated: us-east"),
        ("regions: [{name: us-east}]\npops: [atlantis]", "pop 'atlantis' is not a place"),
        ("regions: [{name: us-east}]\npops: [london, london]", "unique; repeated: london"),
        ("regions: [{name: us-east}]\nclients: [mars]", "client city 'mars' is not a place"),
        ("regions: [{name: us-east}]\nedge: {pops: [tokyo]}", "edge pop 'tokyo' is not one of"),
        ("regions: [{name: us-east}]\nlimits: global", "limits: Input should be 'shared'"),
        ("regions: [{name: us-east}]\ndns_name: Bad_Name", "dns_name: String should match"),
        ("regions: [{name: us-east}]\nenvoy: maybe", "envoy: Input should be 'auto', 'on'"),
        ("regions: [{name: us-east}]\nports: {gateway: 70000}", "ports.gateway: Input should"),
        ("regions: [{name: us-east}", "not valid YAML (line 1)"),
        ("- just a list", "expected a mapping of settings at the top level"),
    ],
)
def test_bad_config_is_one_clear_line(text: str, message: str) -> None:
    with pytest.raises(StackConfigError) as caught:
        parse_config(text, "stack.yaml")
    error = str(caught.value)
    assert error.startswith("stack.yaml: ") and message in error
    assert "\n" not in error
    assert caught.value.status == 2


def test_missing_config_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(StackConfigError, match=r"cannot read stack config .*nope.yaml: No such"):
        load_config(tmp_path / "nope.yaml")


def test_layout_numbers_ports_per_region_and_node_like_the_terraform_example() -> None:
    config = parse_config(
        "regions: [{name: us-east, nodes: 2}, {name: eu-west}]\n"
        "ports: {node_base: 9001, envoy_base: 10001, envoy_admin_base: 10101, "
        "rtt_proxy_base: 10201}\n"
    )
    layout = plan_layout(config, use_envoy=True)
    us_east, eu_west = layout.regions
    assert [(n.node_id, n.port) for n in layout.nodes] == [
        ("us-east-00", 9001),
        ("us-east-01", 9002),
        ("eu-west-00", 9101),
    ]
    assert (us_east.envoy_port, us_east.envoy_admin_port, us_east.rtt_proxy_port) == (
        10001,
        10101,
        10201,
    )
    assert (eu_west.envoy_port, eu_west.rtt_proxy_port) == (10002, 10202)
    # gateway → RTT proxy → Envoy → nodes
    assert us_east.ingress_url == "http://127.0.0.1:10201"
    assert us_east.upstream_urls == ("http://127.0.0.1:10001",)
    # The delay is the RTT the gateway itself computes from the location table.
    expected = rtt_ms(locate("new-york"), REGIONS["eu-west"])
    assert eu_west.rtt_ms == pytest.approx(expected, abs=0.05)


def test_without_envoy_the_proxy_spreads_over_nodes_and_without_proxy_node_zero_is_ingress() -> (
    None
):
    config = parse_config("regions: [{name: us-east, nodes: 2}]")
    proxied = plan_layout(config, use_envoy=False).regions[0]
    assert proxied.envoy_port is None
    assert proxied.upstream_urls == ("http://127.0.0.1:9001", "http://127.0.0.1:9002")
    assert proxied.ingress_url == "http://127.0.0.1:10201"
    direct_config = parse_config("regions: [{name: us-east, nodes: 2}]\nsimulate_rtt: false")
    direct = plan_layout(direct_config, use_envoy=False).regions[0]
    assert direct.ingress_url == "http://127.0.0.1:9001"


def test_ports_that_collide_are_refused_before_anything_starts() -> None:
    config = parse_config("regions: [{name: us-east}]\nports: {anycast_admin: 9001}")
    with pytest.raises(StackError, match="node agent us-east-00 and Anycast front admin would"):
        plan_layout(config, use_envoy=False)
    many = "".join(f"  - {{name: r{i}, lat: 0, lon: 0}}\n" for i in range(3))
    crowded = parse_config(f"regions:\n{many}ports: {{node_base: 65400}}")
    with pytest.raises(StackError, match="node agent r2-00 would listen on port 65600"):
        plan_layout(crowded, use_envoy=False)


def test_default_config_file_is_shipped_inside_the_package() -> None:
    repo_root = Path(__file__).resolve().parents[2]
    assert repo_root / "stack" / "default.yaml" == DEFAULT_CONFIG


def test_each_pop_has_its_own_address_certificate_names_and_paths_to_the_regions() -> None:
    config = parse_config(
        "regions: [{name: us-east}, {name: eu-west}]\n"
        "pops: [new-york, london, singapore]\nclients: [tokyo, paris]\n"
        "edge: {pops: [singapore], max_tokens: 32}\n"
        "ports: {rtt_proxy_base: 10201, gateway: 8443, anycast_base: 8601, edge_base: 9501}\n"
    )
    layout = plan_layout(config, use_envoy=False, has_redis=True)
    assert [(p.name, p.url) for p in layout.pops] == [
        ("new-york", "https://127.0.1.1:8443"),
        ("london", "https://127.0.1.2:8443"),
        ("singapore", "https://127.0.1.3:8443"),
    ]
    us_east, eu_west = layout.regions
    # PoP p reaches region i through its own RTT proxy route, delayed by their own distance.
    assert [(path.pop, path.rtt_proxy_port) for path in eu_west.paths] == [
        ("new-york", 10202),
        ("london", 10302),
        ("singapore", 10402),
    ]
    for path in eu_west.paths:
        assert path.rtt_ms == pytest.approx(rtt_ms(locate(path.pop), REGIONS["eu-west"]), abs=0.05)
    assert layout.pop("london").region_ingress == (
        ("us-east", "http://127.0.0.1:10301"),
        ("eu-west", "http://127.0.0.1:10302"),
    )
    assert us_east.ingress_url == "http://127.0.0.1:10201"  # registered: the first PoP's path
    assert [(p.name, p.edge_url) for p in layout.pops if p.edge_url] == [
        ("singapore", "http://127.0.0.1:9503")
    ]
    assert [(c.city, c.url) for c in layout.clients] == [
        ("tokyo", "https://127.0.0.1:8601"),
        ("paris", "https://127.0.0.1:8602"),
    ]
    assert config.num_nodes == 3  # two regions' nodes and the edge's


def test_stack_certificates_name_each_pop_and_the_api_and_follow_their_names(
    tmp_path: Path,
) -> None:
    from cryptography import x509

    from stack.certs import ensure_pop_tls

    names = {"london": ("127.0.1.2", "api.meridian.test")}
    first = ensure_pop_tls(tmp_path, names)["london"]
    cert = x509.load_pem_x509_certificate(first.cert.read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "api.meridian.test" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == [
        "127.0.0.1",
        "::1",
        "127.0.1.2",
    ]
    pem = first.cert.read_bytes()
    assert ensure_pop_tls(tmp_path, names)["london"].cert.read_bytes() == pem  # kept
    ensure_pop_tls(tmp_path, {"london": ("127.0.1.9",)})
    assert first.cert.read_bytes() != pem  # re-issued for its new address


def test_the_control_plane_is_one_replica_on_sqlite_unless_told() -> None:
    assert load_config().control_plane == ControlPlaneConfig(replicas=1, db="sqlite")
    config = parse_config("regions: [{name: eu-west}]\ncontrol_plane: {replicas: 2, db: postgres}")
    assert config.control_plane == ControlPlaneConfig(replicas=2, db="postgres")


@pytest.mark.parametrize(
    ("section", "error"),
    [
        ("{replicas: 0}", "control_plane.replicas: Input should be greater than or equal to 1"),
        (
            "{replicas: 2}",
            "control_plane: Value error, 2 replicas need `db: postgres` (replicas share one "
            "database; SQLite is one process's)",
        ),
        ("{db: mysql}", "control_plane.db: Input should be 'sqlite' or 'postgres'"),
    ],
)
def test_a_bad_control_plane_section_is_one_line(section: str, error: str) -> None:
    with pytest.raises(StackConfigError) as caught:
        parse_config(f"regions: [{{name: eu-west}}]\ncontrol_plane: {section}\n", "s.yaml")
    assert str(caught.value) == f"s.yaml: {error}"
