"""Request fields by name: the errors and the header that name them (STYLE.md 10a).

Request Structs forbid unknown fields (`forbid_unknown_fields=True`), so msgspec
refuses one while it decodes, at no cost to a request that has none. Only then,
on the error path, the body is read again as plain data to name every unknown
field with the closest known one (difflib over the field names of the Struct it
sits in, nested ones too: `inputs[0]`), and msgspec's type errors (``Expected
`int | null`, got `str` - at `$.top_k` ``) are put in plain words.

Compatibility routes whose original server ignores unknown fields (Ollama, TEI)
decode through `codec.decode_lenient`: the unknown fields are dropped (`strip`)
and named in the `X-Fleet-Ignored-Fields` reply header (`IGNORED_FIELDS_HEADER`),
with the fields the route accepts but does not apply (`set_fields`).
"""

from __future__ import annotations

import difflib
import functools
import re
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Any

import msgspec
import msgspec.inspect as mi

from fleet.errors import BadRequest, UnknownFields

IGNORED_FIELDS_HEADER = "X-Fleet-Ignored-Fields"

_AT = re.compile(r" - at `\$(?P<path>[^`]*)`$")
_STEP = re.compile(r"\.(?P<key>[^.\[]+)|\[(?P<index>\d+|\.\.\.)\]")
# DOTALL: a client's field name may hold a newline.
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>.*)`$", re.DOTALL)
_MISSING = re.compile(r"^Object missing required field `(?P<name>.*)`$", re.DOTALL)
_EXPECTED = re.compile(r"^Expected `(?P<want>[^`]+)`(?P<rest>.*?)(?:, got `(?P<got>[^`]+)`)?$")
_ENUM = re.compile(r"^Invalid enum value (?P<value>.*)$")
#: msgspec's names of wire types, in plain words.
_WORDS = {
    "int": "an integer", "float": "a number", "str": "a string", "bool": "a boolean", "null": "null",
    "array": "a list", "object": "an object", "bytes": "bytes", "ext": "a MessagePack extension",
}
_LISTS = (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)
#: At most this many fields are named in one message or header; longer names are cut.
MAX_NAMED = 16
NAME_CHARS = 64


@dataclass(frozen=True)
class Unknown:
    """One unknown field: where it is (`inputs[0].imgae`), its name, and the known
    field names of the object it sits in."""

    path: str
    name: str
    known: tuple[str, ...]

    @property
    def suggestion(self) -> str | None:
        close = difflib.get_close_matches(self.name, self.known, n=1)
        return close[0] if close else None

    @property
    def parent(self) -> str:
        return self.path[: len(self.path) - len(self.name)].rstrip(".")


# ---- the type tree ---------------------------------------------------------------------

@functools.cache
def type_tree(type_: Any) -> mi.Type:
    return mi.type_info(type_)


def members(t: mi.Type) -> tuple[mi.Type, ...]:
    """The alternatives of a type: a union's members, else the type itself."""
    while isinstance(t, mi.Metadata):
        t = t.type
    if isinstance(t, mi.UnionType):
        return tuple(m.type if isinstance(m, mi.Metadata) else m for m in t.types)
    return (t,)


def structs_of(t: mi.Type) -> list[mi.StructType]:
    return [m for m in members(t) if isinstance(m, mi.StructType)]


def holds_struct(t: mi.Type, seen: frozenset[int] = frozenset()) -> bool:
    """Whether a value of `t` can hold a Struct (nothing to walk into otherwise)."""
    for m in members(t):
        if isinstance(m, mi.StructType):
            return True
        if id(m) in seen:
            continue
        inner: tuple[mi.Type, ...] = ()
        if isinstance(m, _LISTS):
            inner = (m.item_type,)
        elif isinstance(m, mi.TupleType):
            inner = m.item_types
        elif isinstance(m, mi.DictType):
            inner = (m.value_type,)
        if any(holds_struct(i, seen | {id(m)}) for i in inner):
            return True
    return False


def types_at(type_: Any, path: str) -> list[mi.Type]:
    """The types a msgspec error path (`.inputs[0]`, `.options[...]`) can point at in `type_`."""
    nodes = [type_tree(type_)]
    for step in _STEP.finditer(path):
        key, index = step.group("key"), step.group("index")
        found: list[mi.Type] = []
        for node in nodes:
            for m in members(node):
                if key is not None and isinstance(m, mi.StructType):
                    found += [f.type for f in m.fields if f.encode_name == key]
                elif index is not None and isinstance(m, _LISTS):
                    found.append(m.item_type)
                elif index is not None and isinstance(m, mi.TupleType) and index.isdigit():
                    found += list(m.item_types[int(index):int(index) + 1])
                elif index == "..." and isinstance(m, mi.DictType):
                    found.append(m.value_type)
        nodes = found
    return nodes


def field_names(t: mi.Type) -> tuple[str, ...]:
    return tuple(f.encode_name for s in structs_of(t) for f in s.fields)


# ---- unknown fields --------------------------------------------------------------------------

def join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key


def strip(obj: Any, t: mi.Type, path: str = "") -> list[Unknown]:
    """Delete from `obj` (decoded as plain data) every key no Struct of `t` has, at any
    depth; what was deleted, in body order. Only values that can hold a Struct are entered."""
    out: list[Unknown] = []
    if obj.__class__ is dict:
        structs = structs_of(t)
        if structs:
            fields = {f.encode_name: f for s in structs for f in s.fields}
            for key in list(obj):
                field = fields.get(key) if key.__class__ is str else None
                if field is None:
                    out.append(Unknown(join(path, str(key)), str(key), tuple(fields)))
                    del obj[key]
                elif holds_struct(field.type):
                    out += strip(obj[key], field.type, join(path, key))
            return out
        for m in members(t):
            if isinstance(m, mi.DictType) and holds_struct(m.value_type):
                for key, value in obj.items():
                    out += strip(value, m.value_type, f"{path}[{key}]")
    elif obj.__class__ is list:
        for m in members(t):
            if isinstance(m, _LISTS) and holds_struct(m.item_type):
                for i, item in enumerate(obj):
                    out += strip(item, m.item_type, f"{path}[{i}]")
                break
            if isinstance(m, mi.TupleType):
                for i, (item, it) in enumerate(zip(obj, m.item_types)):
                    out += strip(item, it, f"{path}[{i}]")
                break
    return out


def plain(body: bytes, *, msgpack: bool) -> Any:
    """The body as plain data (dicts, lists, ...), or None when it does not parse."""
    try:
        return msgspec.msgpack.decode(body) if msgpack else msgspec.json.decode(body)
    except (msgspec.DecodeError, UnicodeDecodeError, RecursionError):
        return None


def unknown_fields(body: bytes, type_: Any, *, msgpack: bool, name: str, path: str) -> list[Unknown]:
    """Every unknown field of a body msgspec refused for the one at `path`/`name`; that
    one alone when the body does not parse as plain data past it."""
    obj = plain(body, msgpack=msgpack)
    found = strip(obj, type_tree(type_)) if obj is not None else []
    if found:
        return found
    known = tuple(dict.fromkeys(n for t in types_at(type_, path) for n in field_names(t)))
    return [Unknown(join(display(path), name), name, known)]


def shown(name: str) -> str:
    """A client's field name as it may appear in a message or a header: printable ASCII
    (escapes for the rest), at most NAME_CHARS characters."""
    text = name.encode("unicode_escape").decode("ascii")
    return text if len(text) <= NAME_CHARS else text[:NAME_CHARS] + "..."


def listed(items: list[str]) -> str:
    """`items` joined with ", ", the first MAX_NAMED of them, then how many more."""
    more = f", and {len(items) - MAX_NAMED} more" if len(items) > MAX_NAMED else ""
    return ", ".join(items[:MAX_NAMED]) + more


def refusal(unknown: list[Unknown], *, kind: str = "field", none_known: str = "") -> UnknownFields:
    """The native routes' 400: each unknown field with the closest known one. `kind`
    names what was unknown ("field", "query parameter"); `none_known` is the hint when
    there is nothing known to suggest."""
    if len(unknown) == 1:
        u = unknown[0]
        where = f" in `{shown(u.parent)}`" if u.parent else ""
        if u.suggestion:
            hint = f"; did you mean `{u.suggestion}`?"
        elif u.known:
            hint = f"; known {kind}s: " + ", ".join(f"`{k}`" for k in u.known)
        else:
            hint = none_known
        message = f"unknown {kind} `{shown(u.name)}`{where}{hint}"
    else:
        message = f"unknown {kind}s: " + listed(
            [f"`{shown(u.path)}`" + (f" (did you mean `{u.suggestion}`?)" if u.suggestion else "") for u in unknown]
        ) + ("" if unknown[0].known else none_known)
    return UnknownFields(message, [(shown(u.path), u.suggestion) for u in unknown])


def check_query(names: Iterable[str], known: Collection[str], route: str) -> None:
    """Refuse query parameters a route does not take (`refusal`: each with the closest
    known one). `names`: the request's query parameter names (repeats allowed);
    `route`: "GET /v1/models", for the message when it takes none."""
    if unknown := [Unknown(k, k, tuple(known)) for k in dict.fromkeys(names) if k not in known]:
        raise refusal(unknown, kind="query parameter", none_known=f"; {route} takes no query parameters")


def openai_message(fields: list[tuple[str, str | None]]) -> str:
    """OpenAI's wording of the same refusal ("Unrecognized request argument supplied: X")."""
    names = listed([path + (f" (did you mean {s}?)" if s else "") for path, s in fields])
    return f"Unrecognized request argument{'s' if len(fields) > 1 else ''} supplied: {names}"


# ---- type errors in plain words -----------------------------------------------------------------

def display(path: str) -> str:
    """msgspec's `.inputs[0]` as `inputs[0]`."""
    return path[1:] if path.startswith(".") else path


def words(names: str) -> str:
    """`int | null` as "an integer or null"."""
    parts = [_WORDS.get(p.strip(), f"`{p.strip()}`") for p in names.split("|")]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " or " + parts[-1]


def literal_values(type_: Any, path: str) -> list[Any]:
    return [v for t in types_at(type_, path) for m in members(t) if isinstance(m, (mi.LiteralType, mi.EnumType))
            for v in (m.values if isinstance(m, mi.LiteralType) else [e.value for e in m.cls])]


def split(exc: msgspec.ValidationError) -> tuple[str, str]:
    """(what msgspec says, the path it says it at: `.inputs[0]`, "" for the body)."""
    text = str(exc)
    at = _AT.search(text)
    return (text[: at.start()], at.group("path")) if at else (text, "")


def names_unknown(exc: msgspec.ValidationError) -> bool:
    """Whether msgspec refused a field the Struct does not have."""
    return _UNKNOWN.match(split(exc)[0]) is not None


def invalid(exc: msgspec.ValidationError, type_: Any, body: bytes, *, msgpack: bool) -> BadRequest:
    """The 400 for a body msgspec refused: unknown fields by name with the closest known
    one; a wrong type with the field's path and the expected type in plain words."""
    text, path = split(exc)
    field = display(path)
    subject = f"`{field}`" if field else "the body"
    if (m := _UNKNOWN.match(text)) is not None:
        return refusal(unknown_fields(body, type_, msgpack=msgpack, name=m.group("name"), path=path))
    if (m := _MISSING.match(text)) is not None:
        missing = join(field, m.group("name"))
        return BadRequest(f"`{missing}` is required", param=missing)
    if (m := _EXPECTED.match(text)) is not None:
        got = f", got {words(m.group('got'))}" if m.group("got") else ""
        return BadRequest(f"{subject} must be {words(m.group('want'))}{m.group('rest')}{got}", param=field or None)
    if (m := _ENUM.match(text)) is not None:
        values = ", ".join(msgspec.json.encode(v).decode() for v in literal_values(type_, path))
        return BadRequest(f"{subject} must be one of {values}, got {m.group('value')}", param=field or None)
    return BadRequest(f"{subject}: {text[:1].lower()}{text[1:]}", param=field or None)


# ---- fields accepted, not applied ------------------------------------------------------------------

def set_fields(req: msgspec.Struct, names: tuple[str, ...]) -> list[str]:
    """Those of `names` the request sets to something other than their default
    (fields a route accepts but does not apply: they go in the header)."""
    defaults = defaults_of(type(req))
    return [name for name in names if getattr(req, name) is not None and getattr(req, name) != defaults.get(name)]


@functools.cache
def defaults_of(cls: type) -> dict[str, Any]:
    """Each field's default (its factory's value for `[]`-like defaults)."""
    return {f.name: f.default_factory() if f.default_factory is not msgspec.NODEFAULT else f.default
            for f in msgspec.structs.fields(cls) if not f.required}


def ignored_header(names: list[str]) -> dict[str, str]:
    """`X-Fleet-Ignored-Fields: a,b` (nothing when nothing was ignored)."""
    if not names:
        return {}
    more = [f"+{len(names) - MAX_NAMED} more"] if len(names) > MAX_NAMED else []
    return {IGNORED_FIELDS_HEADER: ",".join([shown(n) for n in names[:MAX_NAMED]] + more)}
