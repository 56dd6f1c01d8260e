"""A config built from settings by its fields' names."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import pytest

from wire.config_fields import config_from


@dataclass(frozen=True, slots=True)
class Limits:
    max_connections: int
    timeout_s: float = 1.0


def test_each_field_comes_from_the_setting_of_its_name_and_the_rest_are_left() -> None:
    settings = SimpleNamespace(max_connections=3, timeout_s=2.5, unrelated="x")
    assert config_from(Limits, settings) == Limits(max_connections=3, timeout_s=2.5)


def test_a_setting_missing_is_an_error_not_a_default() -> None:
    with pytest.raises(AttributeError):
        config_from(Limits, SimpleNamespace(max_connections=3))
