"""API messages as JSON documents, and back.

A message prints with its proto field names (``wait_p95_s``, not ``waitP95S``) and every field
present: a field without presence prints its default (``0``, ``false``, ``""``, ``[]``, ``{}``)
and an unset ``optional`` or message field prints as ``null``, so a reader sees the whole shape
whatever the values. Integer fields are 32-bit and print as JSON numbers.

Reading is lenient the way a newer or older peer needs: unknown keys are ignored and ``null``
leaves a field unset.
"""

from __future__ import annotations

from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import Message

M = TypeVar("M", bound=Message)


def to_document(message: Message) -> dict[str, Any]:
    """``message`` as a JSON-ready dict: proto field names in field order, every field present."""
    doc: dict[str, Any] = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    return _shape(message, doc)


def _shape(message: Message, doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` in the message's field order, with ``null`` for unset fields that have presence."""
    out: dict[str, Any] = {}
    for field in message.DESCRIPTOR.fields:
        name = field.name
        value = getattr(message, name)
        if field.message_type is not None and field.message_type.GetOptions().map_entry:
            out[name] = doc.get(name, {})
        elif field.is_repeated:
            items = doc.get(name, [])
            out[name] = ([_shape(m, d) for m, d in zip(value, items, strict=True)]
                         if field.message_type is not None else items)
        elif field.has_presence and not message.HasField(name):
            out[name] = None
        elif field.message_type is not None:
            out[name] = _shape(value, doc[name])
        else:
            out[name] = doc[name]
    return out


def from_document(doc: Any, message_type: type[M]) -> M:
    """A message of ``message_type`` from a document: unknown keys ignored, ``null`` is unset.

    Raises :class:`ValueError` when a known field has a value of the wrong type.
    """
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    message = message_type()
    try:
        json_format.ParseDict(doc, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise ValueError(str(exc)) from exc
    return message
