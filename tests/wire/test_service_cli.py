"""The services' shared command line (wire/service_cli.py): flags not given stay out of the
namespace, and a failed start is one line on stderr."""

from __future__ import annotations

import errno

import pytest

from wire.service_cli import (
    add_control_plane_flags,
    add_listen_flags,
    add_log_level_flag,
    cannot_listen,
    fail,
    service_parser,
)


def test_only_the_flags_given_reach_the_namespace() -> None:
    parser = service_parser("svc", "A service.")
    add_listen_flags(parser, default_port=9001)
    add_control_plane_flags(parser)
    add_log_level_flag(parser)
    assert vars(parser.parse_args([])) == {}
    args = parser.parse_args(["--port", "9100", "--control-plane", "http://a,http://b"])
    assert vars(args) == {"port": 9100, "control_plane": "http://a,http://b"}
    assert parser.prog == "python -m svc"
    assert "(default 9001)" in parser.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--log-level", "LOUD"])


def test_a_failed_start_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    taken = OSError(errno.EADDRINUSE, "Address already in use")
    assert fail("svc", cannot_listen("127.0.0.1", 80, taken, " for metrics"), 1) == 1
    assert capsys.readouterr().err == (
        "svc: error: cannot listen on 127.0.0.1:80 for metrics: Address already in use\n"
    )
