"""Can a JSON schema produce any value at all? Checked before a request is admitted, so that a schema which
compiles but leaves the grammar with no allowed token part-way through (the classic: a required property whose
`$ref` refers only to itself) is refused with a 400 naming the problem instead of failing mid-decode.

A schema part is *productive* when some finite JSON value satisfies it. This is the least fixpoint over the
document's local `$ref` targets (as for the productive non-terminals of a grammar): start with every target
unproductive, and mark one productive once its schema is, given what is known so far, until nothing changes.
A `$ref` cycle with no way out (every path back to itself is required) never becomes productive.

The rules are deliberately conservative, erring towards "productive": only structure that forces a value is
followed (required properties, minItems, allOf / anyOf / oneOf, `false`, an empty enum); anything else the
grammar library judges for itself when it compiles the schema.
"""

from __future__ import annotations

from collections import deque

_COMBINED = ("allOf", "anyOf", "oneOf")


def _pointer(doc, ref: str):
    """The part of `doc` a local reference ("#", "#/$defs/A") names; None when it names nothing here."""
    if ref == "#":
        return doc
    if not ref.startswith("#/"):
        return None
    node = doc
    for raw in ref[2:].split("/"):
        key = raw.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def _refs(schema, out: set[str]) -> set[str]:
    """Every local `$ref` string anywhere inside `schema`."""
    stack = [schema]
    while stack:
        s = stack.pop()
        if isinstance(s, dict):
            r = s.get("$ref")
            if isinstance(r, str) and r.startswith("#"):
                out.add(r)
            stack.extend(s.values())
        elif isinstance(s, list):
            stack.extend(s)
    return out


def _types(s: dict) -> list[str] | None:
    t = s.get("type")
    if isinstance(t, str):
        return [t]
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return t
    return None  # no (readable) type: any type may do


def _object_ok(s: dict, known) -> bool:
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    extra = s.get("additionalProperties", True)
    required = s.get("required") if isinstance(s.get("required"), list) else []
    for name in required:
        if not isinstance(name, str):
            continue
        sub = props.get(name, extra)
        if not _productive(sub, known):
            return False
    return True


def _array_ok(s: dict, known) -> bool:
    n = s.get("minItems", 0)
    if not isinstance(n, int) or n <= 0:
        return True
    prefix = s.get("prefixItems") if isinstance(s.get("prefixItems"), list) else []
    items = s.get("items", True)
    for i in range(min(n, len(prefix))):
        if not _productive(prefix[i], known):
            return False
    return n <= len(prefix) or _productive(items, known)


def _productive(s, known) -> bool:
    """Whether `s` admits a value, reading each `$ref` from `known` (ref -> bool) instead of following it."""
    if s is False:
        return False
    if not isinstance(s, dict):
        return True
    r = s.get("$ref")
    if isinstance(r, str) and not known(r):
        return False
    for key in _COMBINED:
        subs = s.get(key)
        if isinstance(subs, list) and subs:
            parts = [_productive(x, known) for x in subs]
            if not (all(parts) if key == "allOf" else any(parts)):
                return False
    if isinstance(s.get("enum"), list) and not s["enum"]:
        return False
    types = _types(s)
    if types is None:
        return True
    checks = {"object": _object_ok, "array": _array_ok}
    return any(checks[t](s, known) if t in checks else True for t in types)


def unsatisfiable(schema) -> str | None:
    """None when `schema` admits some value; else a sentence naming why not (the `$ref`s that never produce a
    value, when that is the cause)."""
    if not isinstance(schema, (dict, bool)):
        return None
    refs = _refs(schema, set())
    target = {r: _pointer(schema, r) for r in refs}
    good: set[str] = {r for r in refs if target[r] is None}  # unresolvable: the grammar library reports those

    def known(r: str) -> bool:
        return r in good or r not in target

    users: dict[str, set[str]] = {r: set() for r in refs}  # ref -> the targets whose schema mentions it
    for r in refs:
        if target[r] is not None:
            for inner in _refs(target[r], set()):
                users.setdefault(inner, set()).add(r)
    todo = deque(r for r in refs if r not in good)
    while todo:  # each target turns productive at most once; only the targets that mention it are re-read
        r = todo.popleft()
        if r in good or not _productive(target[r], known):
            continue
        good.add(r)
        todo.extend(u for u in users.get(r, ()) if u not in good)
    if _productive(schema, known):
        return None
    bad = sorted(r for r in refs if r not in good)
    if bad:
        names = ", ".join(bad[:3]) + (f" (and {len(bad) - 3} more)" if len(bad) > 3 else "")
        return (f"it can never be satisfied: {names} never produces a value (a $ref cycle with no way out: "
                "every path through it leads back to itself)")
    return "it can never be satisfied: no JSON value matches it"
