"""Envoy's protoc-gen-validate rules, checked in Python: `proto_violations(message)`.

Envoy's protos carry PGV annotations (required fields, number ranges, string lengths and patterns,
known enum values, list sizes); Envoy rejects a resource that breaks one. This walks any message
generically by its descriptors, into `Any` fields whose type is imported here, and reports every
broken rule with its path. Rules are read from the descriptors once per message type.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import any_pb2, duration_pb2, symbol_database
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from validate import validate_pb2

TYPE_PREFIX = "type.googleapis.com/"  # of every `Any` type URL

_NUMBER_KINDS = frozenset(
    {"float", "double", "int32", "int64", "uint32", "uint64", "sint32", "sint64"}
    | {"fixed32", "fixed64", "sfixed32", "sfixed64"}
)
_HEADER_PATTERNS = {  # PGV's well-known regexes: (strict, lax)
    validate_pb2.HTTP_HEADER_NAME: (r"^:?[0-9a-zA-Z!#$%&'*+\-.^_|~`]+$", r"^[^\x00\n\r]*$"),
    validate_pb2.HTTP_HEADER_VALUE: (r"^[^\x00-\x08\x0A-\x1F\x7F]*$", r"^[^\x00\n\r]*$"),
}


@dataclass(frozen=True, slots=True)
class _MessageRules:
    """The PGV annotations of one message type, read once (reading options is slow)."""

    is_disabled: bool
    required_oneofs: tuple[str, ...]
    fields: tuple[tuple[FieldDescriptor, validate_pb2.FieldRules], ...]
    field_names: frozenset[str]


@functools.cache
def _rules_of(descriptor_: Descriptor) -> _MessageRules:
    options = descriptor_.GetOptions()
    is_disabled = options.HasExtension(validate_pb2.disabled) and bool(
        options.Extensions[validate_pb2.disabled]
    )
    required_oneofs = tuple(
        oneof.name
        for oneof in descriptor_.oneofs
        if oneof.GetOptions().HasExtension(validate_pb2.required)
        and oneof.GetOptions().Extensions[validate_pb2.required]
    )
    fields = tuple(
        (field, field.GetOptions().Extensions[validate_pb2.rules])
        for field in descriptor_.fields
        if field.GetOptions().HasExtension(validate_pb2.rules)
    )
    names = frozenset(field.name for field, _ in fields)
    return _MessageRules(is_disabled, required_oneofs, fields, names)


_BOUNDS = {
    "const": lambda value, limit: value == limit,
    "lt": lambda value, limit: value < limit,
    "lte": lambda value, limit: value <= limit,
    "gt": lambda value, limit: value > limit,
    "gte": lambda value, limit: value >= limit,
}


def _check_bounds(
    path: str,
    value: float,
    bounds: Mapping[str, float],
    allowed: Sequence[float] = (),
    forbidden: Sequence[float] = (),
) -> list[str]:
    problems = [
        f"{path}: {value} violates {name} {limit}"
        for name, limit in bounds.items()
        if not _BOUNDS[name](value, limit)
    ]
    if allowed and value not in allowed:
        problems.append(f"{path}: {value} is not one of {list(allowed)}")
    if value in forbidden:
        problems.append(f"{path}: {value} is not allowed")
    return problems


def _check_number(path: str, value: float, rules: Any) -> list[str]:
    """`rules`: any of PGV's number rules (UInt32Rules, DoubleRules, ...), all the same shape."""
    bounds = {name: getattr(rules, name) for name in _BOUNDS if rules.HasField(name)}
    return _check_bounds(path, value, bounds, getattr(rules, "in"), rules.not_in)


def _check_duration(
    path: str, value: duration_pb2.Duration, rules: validate_pb2.DurationRules
) -> list[str]:
    bounds = {name: _nanos(getattr(rules, name)) for name in _BOUNDS if rules.HasField(name)}
    allowed = [_nanos(d) for d in getattr(rules, "in")]
    forbidden = [_nanos(d) for d in rules.not_in]
    return _check_bounds(path, _nanos(value), bounds, allowed, forbidden)


def _check_string(path: str, value: str, rules: validate_pb2.StringRules) -> list[str]:
    if rules.ignore_empty and not value:
        return []
    size, num_bytes = len(value), len(value.encode())
    checks = (
        ("min_len", size >= rules.min_len),
        ("max_len", size <= rules.max_len),
        ("len", size == rules.len),
        ("min_bytes", num_bytes >= rules.min_bytes),
        ("max_bytes", num_bytes <= rules.max_bytes),
        ("prefix", value.startswith(rules.prefix)),
        ("suffix", value.endswith(rules.suffix)),
        ("contains", rules.contains in value),
        ("not_contains", rules.not_contains not in value),
        ("pattern", re.search(rules.pattern, value) is not None),
    )
    problems = [
        f"{path}: {value!r} violates {name}"
        for name, holds in checks
        if rules.HasField(name) and not holds
    ]
    if getattr(rules, "in") and value not in getattr(rules, "in"):
        problems.append(f"{path}: {value!r} is not one of {list(getattr(rules, 'in'))}")
    if rules.HasField("well_known_regex") and rules.well_known_regex in _HEADER_PATTERNS:
        strict, lax = _HEADER_PATTERNS[rules.well_known_regex]
        is_strict = rules.strict if rules.HasField("strict") else True
        if re.search(strict if is_strict else lax, value) is None:
            problems.append(f"{path}: {value!r} is not a valid header name or value")
    return problems


def _nanos(value: duration_pb2.Duration) -> int:
    return value.seconds * 10**9 + value.nanos


def _check_message_rules(
    path: str, field: FieldDescriptor, value: Message | None, rules: validate_pb2.FieldRules
) -> list[str]:
    kind = rules.WhichOneof("type")
    required = (kind == "message" and rules.message.required) or (
        kind in ("duration", "any") and getattr(rules, kind).required
    )
    if value is None:
        return [f"{path}: is required"] if required else []
    if kind == "duration":
        assert isinstance(value, duration_pb2.Duration)
        return _check_duration(path, value, rules.duration)
    if kind == "any":
        assert isinstance(value, any_pb2.Any)
        allowed = list(getattr(rules.any, "in"))
        if allowed and value.type_url not in allowed:
            return [f"{path}: type {value.type_url} is not one of {allowed}"]
        return []
    if kind in _NUMBER_KINDS and field.message_type.name.endswith("Value"):
        return _check_number(path, getattr(value, "value"), getattr(rules, kind))  # noqa: B009
    return []


def _check_scalar(
    path: str, field: FieldDescriptor, value: object, rules: validate_pb2.FieldRules
) -> list[str]:
    kind = rules.WhichOneof("type")
    if kind in _NUMBER_KINDS:
        number_rules = getattr(rules, kind)
        if getattr(number_rules, "ignore_empty", False) and not value:
            return []
        assert isinstance(value, int | float)
        return _check_number(path, value, number_rules)
    if kind == "string":
        assert isinstance(value, str)
        return _check_string(path, value, rules.string)
    if kind == "enum" and rules.enum.defined_only:
        assert isinstance(value, int)
        if value not in field.enum_type.values_by_number:
            return [f"{path}: {value} is not a defined {field.enum_type.name}"]
    return []


def _check_field(
    path: str, field: FieldDescriptor, value: object, rules: validate_pb2.FieldRules | None
) -> list[str]:
    problems: list[str] = []
    if field.type == FieldDescriptor.TYPE_MESSAGE:
        assert value is None or isinstance(value, Message)
        if rules is not None:
            problems += _check_message_rules(path, field, value, rules)
        skip = rules is not None and rules.WhichOneof("type") == "message" and rules.message.skip
        if value is not None and not skip:
            problems += proto_violations(value, path)
    elif rules is not None:
        problems += _check_scalar(path, field, value, rules)
    return problems


def proto_violations(message: Message, path: str = "") -> list[str]:
    """What Envoy's proto validation would reject in `message` (one line per problem)."""
    rules = _rules_of(message.DESCRIPTOR)
    if rules.is_disabled:
        return []
    if isinstance(message, any_pb2.Any):
        return _any_violations(message, path)
    problems = [
        f"{path}.{name}: one of its fields is required".lstrip(".")
        for name in rules.required_oneofs
        if message.WhichOneof(name) is None
    ]
    for field, field_rules in rules.fields:
        problems += _field_violations(message, field, field_rules, path)
    for field, _ in message.ListFields():  # set sub-messages without rules of their own
        if field.type == FieldDescriptor.TYPE_MESSAGE and field.name not in rules.field_names:
            problems += _field_violations(message, field, None, path)
    return problems


def _field_violations(
    message: Message,
    field: FieldDescriptor,
    rules: validate_pb2.FieldRules | None,
    parent_path: str,
) -> list[str]:
    oneof = field.containing_oneof
    if oneof is not None and message.WhichOneof(oneof.name) != field.name:
        return []  # only the member that is set is validated
    path = f"{parent_path}.{field.name}".lstrip(".")
    value = getattr(message, field.name)
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        items = [(key, item) for key, item in value.items() if isinstance(item, Message)]
        return [p for key, item in items for p in proto_violations(item, f"{path}[{key}]")]
    if field.is_repeated:
        problems: list[str] = []
        item_rules = None
        if rules is not None and rules.WhichOneof("type") == "repeated":
            repeated = rules.repeated
            if repeated.HasField("min_items") and len(value) < repeated.min_items:
                problems.append(f"{path}: needs at least {repeated.min_items} item(s)")
            if repeated.HasField("max_items") and len(value) > repeated.max_items:
                problems.append(f"{path}: allows at most {repeated.max_items} item(s)")
            item_rules = repeated.items if repeated.HasField("items") else None
        for index, item in enumerate(value):
            problems += _check_field(f"{path}[{index}]", field, item, item_rules)
        return problems
    if field.type == FieldDescriptor.TYPE_MESSAGE and not message.HasField(field.name):
        value = None
    return _check_field(path, field, value, rules)


def _any_violations(packed: any_pb2.Any, path: str) -> list[str]:
    type_name = packed.type_url.removeprefix(TYPE_PREFIX)
    try:
        message_class = symbol_database.Default().GetSymbol(type_name)
    except KeyError:
        return []  # a type not imported here: Envoy will judge it
    message = message_class()
    if not packed.Unpack(message):
        return [f"{path}: cannot unpack {type_name}"]
    return proto_violations(message, f"{path}<{type_name.rsplit('.', 1)[-1]}>")
