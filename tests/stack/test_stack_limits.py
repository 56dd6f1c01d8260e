"""The stack's per-key limits: each PoP's buckets in a redis-server of its own (when one is
installed and `limits: shared`), its gateway pointed at it, and the mode in words."""

from __future__ import annotations

from pathlib import Path

from stack import commands
from stack.certs import GatewayTls
from stack.config import parse_config
from stack.layout import plan_layout
from stack.summary import limits_mode

CONFIG = "regions: [{name: us-east}]\npops: [new-york, london, singapore]\n"
TLS = GatewayTls(Path("ca.pem"), Path("cert.pem"), Path("key.pem"))
TOKENS = {commands.GATEWAY_TOKEN: "g" * 20, commands.SERVING_TOKEN: "s" * 20}


def test_each_pop_keeps_its_buckets_in_a_redis_server_of_its_own() -> None:
    config = parse_config(CONFIG)
    layout = plan_layout(config, use_envoy=False, has_redis=True)
    assert [pop.redis_url for pop in layout.pops] == [
        "redis://127.0.0.1:6390/0",
        "redis://127.0.0.1:6391/0",
        "redis://127.0.0.1:6392/0",
    ]
    assert ("127.0.0.1", 6391, "redis-server london") in layout.tcp_sockets()
    london = layout.pop("london")
    gateway = commands.gateway(config, layout, london, TLS, TOKENS)
    assert gateway.argv[gateway.argv.index("--redis") + 1] == "redis://127.0.0.1:6391/0"
    redis = commands.redis_server("/bin/redis-server", london, Path("/tmp"))
    assert (redis.name, redis.kind, redis.url) == ("redis london", "redis", london.redis_url)
    assert redis.argv[redis.argv.index("--port") + 1] == "6391"
    assert limits_mode(layout) == (
        "across PoPs by the control plane's shares; each PoP's buckets in a redis-server of its "
        "own (ports 6390, 6391, 6392)"
    )


def test_without_redis_each_pop_keeps_its_buckets_in_its_gateway() -> None:
    for config, has_redis in (
        (parse_config(CONFIG + "limits: local"), True),
        (parse_config(CONFIG), False),
    ):
        layout = plan_layout(config, use_envoy=False, has_redis=has_redis)
        assert [pop.redis_url for pop in layout.pops] == [None, None, None]
        gateway = commands.gateway(config, layout, layout.pop("london"), TLS, TOKENS)
        assert "--redis" not in gateway.argv
        assert limits_mode(layout) == (
            "across PoPs by the control plane's shares; each PoP's buckets in its gateway process"
        )
