"""Reading a config: a validation failure as one ``ValueError`` line naming the field and
what to change (``config_error``), an algorithm's own options read as its model
(``parse_options``), and a command line's KEY=VALUE options (``option_pairs``).

It knows the config's sections only as pydantic models (a section's ``moved_keys`` and
``retired_keys`` are read by name), so it sits below ``spin_cluster.config``, which
re-exports these names: callers import them from there.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError


def parse_config(kind: type[BaseModel], data: Any, where: tuple[str, ...] = ()) -> Any:
    """``kind.model_validate(data)``, with a failure as one ``ValueError`` line (``config_error``);
    ``where``: the section's place in the config file, as the message names it."""
    try:
        return kind.model_validate(data)
    except ValidationError as e:
        raise ValueError(config_error(e, kind, where)) from None


def config_error(error: ValidationError, kind: type[BaseModel], where: tuple[str, ...] = ()) -> str:
    """The first of ``error``'s failures as one line: ``cache.page_size=3: use a power of two
    in 1..256``. Checks across fields name their fields themselves, so their text stands alone."""
    first = error.errors(include_url=False)[0]
    loc = tuple(first["loc"])
    path = _dotted(where + loc)
    kind_, ctx, value = first["type"], first.get("ctx") or {}, first.get("input")
    if kind_ == "extra_forbidden":
        section = _section_at(kind, loc[:-1])
        if retired := getattr(section, "retired_keys", {}).get(loc[-1]):
            return retired
        if moved := getattr(section, "moved_keys", {}).get(loc[-1]):
            return f"{path} moved to {_dotted(where + loc[:-1] + (moved,))}"
        known = ", ".join(sorted(section.model_fields))
        what = "unknown config section" if not where and len(loc) == 1 else "unknown key"
        return f"{path}: {what}; known: {known}"
    if kind_ == "value_error" and _section_at(kind, loc) is not None:  # a check across a section's fields
        return str(ctx.get("error", first["msg"]))
    return f"{path}={value!r}: {_explain(kind_, ctx, value, first['msg'])}" if path else first["msg"]


def parse_options(model: type[BaseModel], algorithm: str, options: dict[str, Any] | None,
                  where: tuple[str, ...]) -> Any:
    """``options`` (an algorithm's own, at ``where`` in the config file) as ``algorithm``'s
    ``model``; a failure as one ``ValueError`` line naming the option (``config_error``)."""
    try:
        return model.model_validate(options or {})
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        if first["type"] != "extra_forbidden":
            raise ValueError(config_error(e, model, where)) from None
        raise ValueError(f"{_dotted(where)}: {algorithm!r} takes no option {first['loc'][0]!r}; its options: "
                         f"{', '.join(sorted(model.model_fields)) or 'none'}") from None


def _explain(kind: str, ctx: dict[str, Any], value: Any, msg: str) -> str:
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        bound = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {int(bound) if float(bound).is_integer() else bound}"
    if kind == "value_error":
        return str(ctx.get("error", msg))
    if kind == "literal_error":
        return f"choose one of {ctx['expected']}"
    if kind.startswith("bool_"):
        return "use true or false"
    if kind.startswith("int_"):
        return "use an integer"
    if kind.startswith("float_"):
        return "use a number"
    if kind in ("model_type", "model_attributes_type", "dict_type"):
        return f"must be a mapping, got {type(value).__name__}"
    if kind in ("tuple_type", "list_type"):
        return f"must be a list, got {type(value).__name__}"
    if kind == "string_type":
        return "use a string"
    return msg


def _dotted(loc: tuple[Any, ...]) -> str:
    """('sparse', 'options', 'per_head_budgets', 0, 1) -> 'sparse.options.per_head_budgets[0][1]'."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else f".{part}" if out else str(part)
    return out


def _section_at(kind: Any, loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The section that ``loc`` names under ``kind``, None where it names a value."""
    for name in loc:
        field = kind.model_fields.get(name) if isinstance(name, str) else None
        if field is None:
            return None
        kind = field.annotation
        if not (isinstance(kind, type) and issubclass(kind, BaseModel)):
            return None
    return kind


def option_pairs(pairs: list[str]) -> dict:
    """KEY=VALUE strings (a command line's ``sparse.options``) -> {key: bool, int, float or str
    value}."""
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"option {pair!r}: write KEY=VALUE")
        if value.lower() in ("true", "false"):
            out[key] = value.lower() == "true"
            continue
        for cast in (int, float):
            try:
                out[key] = cast(value)
                break
            except ValueError:
                continue
        else:
            out[key] = value
    return out
