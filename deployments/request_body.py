"""A request body's JSON, read under shape limits before any model sees it.

Every way a body can be malformed ends here as an ``ApiError`` 400 that says what is wrong:
bytes that are not UTF-8 JSON, nesting deeper than ``MAX_DEPTH`` (which would otherwise
exhaust the parser's or the validator's recursion), ``NaN``/``Infinity`` (Python's parser
accepts them; JSON does not), integers outside 64 bits, and a top level that is not an
object. The size limit is the ingress's (``serve.max_body_bytes``), checked while reading.
"""

from __future__ import annotations

import json
from typing import Any

from spin_cluster.deployments.errors import ApiError

# Deepest nesting of arrays and objects. OpenAI bodies need 4
# ({"messages": [{"content": [{"type": ..}]}]}); the rest is room for extensions.
MAX_DEPTH = 32
# Integers must fit a signed 64-bit value: seeds, token ids and counts end up in tensors.
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


def load_json_object(raw: bytes) -> dict[str, Any]:
    try:
        data = json.loads(raw, parse_constant=_refuse_constant)
    except RecursionError:
        raise _too_deep() from None
    except UnicodeDecodeError as e:
        raise ApiError(400, f"the body is not valid UTF-8: {e.reason} at byte {e.start}",
                       code="invalid_json") from None
    except ValueError as e:  # JSONDecodeError, a constant refused above, an over-long integer
        raise ApiError(400, f"the body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the body must be a JSON object", code="invalid_json")
    _check_shape(data)
    return data


def _check_shape(data: Any) -> None:
    """Depth and integer range, walked without recursion (a stack of (value, depth))."""
    stack = [(data, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, (dict, list)):
            if depth > MAX_DEPTH:
                raise _too_deep()
            children = value.values() if isinstance(value, dict) else value
            stack.extend((child, depth + 1) for child in children)
        elif isinstance(value, int) and not isinstance(value, bool) and not _INT_MIN <= value <= _INT_MAX:
            raise ApiError(400, "the body holds an integer outside the signed 64-bit range",
                           code="invalid_value")


def _too_deep() -> ApiError:
    return ApiError(400, f"the body nests arrays and objects more than {MAX_DEPTH} levels deep",
                    code="invalid_json")


def _refuse_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")
