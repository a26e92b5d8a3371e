"""JSON schemas the structured-output tests enforce on the random-weight model.

Every string, array and number is bounded (maxLength, maxItems, ranges, enums, patterns,
formats): near-flat logits rarely close an unbounded string, so only bounded schemas can be
expected to finish with "stop" within the token limit. Together they cover nested objects,
arrays with min/max items, enums and consts, required and optional fields, integer and number
ranges, string patterns and formats, anyOf/oneOf, $defs/$ref, nullable types and booleans.
"""

from __future__ import annotations

S = {"type": "string", "maxLength": 6}
I = {"type": "integer", "minimum": -50, "maximum": 50}  # noqa: E741
REF_A, REF_B = {"$ref": "#/$defs/A"}, {"$ref": "#/$defs/B"}


def obj(props: dict, required: list[str] | None = None, **extra) -> dict:
    """A closed object (no additional properties) with ``props``; all required by default."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
        **extra,
    }


SCHEMAS: list[dict] = [
    obj({"a": I}),
    obj({"name": S, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"flag": {"type": "boolean"}}),
    obj({"color": {"enum": ["red", "green", "blue"]}}),
    obj({"kind": {"const": "point"}, "x": I, "y": I}),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"ids": {"type": "array", "items": I, "maxItems": 4}}),
    obj(
        {
            "matrix": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 2,
                    "maxItems": 2,
                },
                "minItems": 2,
                "maxItems": 2,
            }
        }
    ),
    obj({"user": obj({"id": I, "name": S})}),
    obj({"a": obj({"b": obj({"c": {"type": "boolean"}})})}),
    obj({"x": I, "y": S}, required=["x"]),
    obj({"opt1": S, "opt2": I, "opt3": {"type": "boolean"}}, required=[]),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}}),
    obj({"hex": {"type": "string", "pattern": "^#[0-9a-f]{6}$"}}),
    obj({"day": {"type": "string", "format": "date"}}),
    obj({"at": {"type": "string", "pattern": "^[01][0-9]:[0-5][0-9]$"}}),
    obj({"id": {"type": "string", "format": "uuid"}}),
    obj({"ip": {"type": "string", "format": "ipv4"}}),
    obj({"score": {"type": "integer", "minimum": 1, "maximum": 5}}),
    obj({"big": {"type": "integer", "minimum": 1000, "maximum": 9999}}),
    obj({"neg": {"type": "integer", "minimum": -9, "maximum": -1}}),
    obj({"ratio": {"enum": [0.25, 0.5, 0.75]}}),
    obj({"temp": {"type": "number", "enum": [-1.5, 0, 2.25]}}),
    obj({"value": {"anyOf": [I, {"type": "boolean"}]}}),
    obj(
        {
            "shape": {
                "oneOf": [
                    obj({"r": {"type": "integer", "minimum": 1, "maximum": 9}}),
                    obj({"w": I, "h": I}),
                ]
            }
        }
    ),
    obj(  # a discriminated union over $refs: a oneOf enforced as anyOf (llguidance's option)
        {
            "parts": {
                "type": "array",
                "items": {"oneOf": [REF_A, REF_B]},
                "minItems": 1,
                "maxItems": 3,
            }
        },
        **{
            "$defs": {
                "A": obj({"kind": {"const": "a"}, "x": I}),
                "B": obj({"kind": {"const": "b"}, "y": S}),
            }
        },
    ),
    obj({"maybe": {"type": ["integer", "null"], "minimum": 0, "maximum": 9}}),
    obj({"n": {"type": "null"}}),
    obj({"level": {"enum": ["low", "mid", "high"]}, "count": I}),
    obj(
        {
            "items": {
                "type": "array",
                "items": obj({"sku": S, "qty": I}),
                "minItems": 1,
                "maxItems": 2,
            }
        }
    ),
    obj({"point": {"$ref": "#/$defs/pt"}}, **{"$defs": {"pt": obj({"x": I, "y": I})}}),
    obj(
        {"pts": {"type": "array", "items": {"$ref": "#/$defs/pt"}, "maxItems": 2}},
        **{"$defs": {"pt": obj({"x": I})}},
    ),
    obj({"name": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj({"letters": {"type": "string", "pattern": "^[a-z]{1,5}$"}}),
    obj({"empty": obj({})}),
    obj({"bits": {"type": "array", "items": {"type": "boolean"}, "minItems": 3, "maxItems": 3}}),
    obj({"words": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 5}}),
    obj({"status": {"enum": ["ok", "error"]}, "message": S}, required=["status"]),
    obj(
        {"first": S, "last": S, "email": {"type": "string", "format": "email", "maxLength": 20}},
        required=["first"],
    ),
    obj({"version": {"type": "string", "pattern": "^[0-9]\\.[0-9]\\.[0-9]$"}}),
    obj(
        {
            "lat": {"type": "integer", "minimum": -90, "maximum": 90},
            "lon": {"type": "integer", "minimum": -180, "maximum": 180},
        }
    ),
    obj({"pair": {"type": "array", "prefixItems": [I, S], "items": False, "minItems": 2}}),
    obj({"answer": {"enum": [True, False, None]}}),
    obj(
        {
            "month": {"type": "integer", "minimum": 1, "maximum": 12},
            "year": {"type": "integer", "minimum": 1990, "maximum": 2030},
        }
    ),
    obj(
        {
            "node": obj(
                {
                    "left": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
                    "right": {"type": ["integer", "null"], "minimum": 0, "maximum": 5},
                }
            )
        }
    ),
    obj({"priority": {"type": "integer", "enum": [1, 2, 3]}, "done": {"type": "boolean"}}),
    obj({"meta": obj({"k": S, "v": I}, required=["k"])}),
    obj(
        {
            "grid": {
                "type": "array",
                "items": {"enum": ["x", "o", "_"]},
                "minItems": 9,
                "maxItems": 9,
            }
        }
    ),
    obj({"ok": {"const": True}, "n": {"type": "integer", "minimum": 0, "maximum": 3}}),
    obj({"label": {"type": "string", "pattern": "^(yes|no|maybe)$"}}),
    obj(
        {
            "contact": {
                "anyOf": [
                    obj({"phone": {"type": "string", "pattern": "^[0-9]{4}$"}}),
                    obj({"mail": S}),
                ]
            }
        }
    ),
    {"type": "array", "items": I, "minItems": 1, "maxItems": 3},
    {"enum": ["alpha", "beta", "gamma"]},
]
