"""`helm template`, for the tests, in Python: Go's text/template and the Sprig functions that
deploy/helm/streamdiloco uses, and Helm's rendering of a chart (values.yaml coalesced with -f files, the
built-in objects, every template but the `_` partials, the output split into YAML documents).

Helm is a Go program that no registry here ships, and no maintained Python package renders Go templates
(PyPI's `go-template` is a 2019 ctypes binding to a Go shared library that must be built first,
`cognihub-pygotemplate` a 0.0.2 CGo wrapper; `pyhelm3` and `chartpress` call the helm binary). So this
file follows Go's semantics where a chart could depend on them, and refuses what it does not know (an
unknown function, a field of nil, comparing a number from values with an integer literal) with the error
Helm would give, rather than rendering something Helm would not:
- numbers from values files are float64 (Helm reads values through JSON), printed as Go prints them
  (1e+06 for a million: the chart must say `int`); literals in templates are int;
- `eq`/`lt` on a float and an int is an error, as in Go; a missing map key is nil, printed as "";
- `toYaml` sorts keys and drops its last newline; `and`/`or` return an operand, short-circuit.
It must not grow into a general template engine: add a function when the chart needs it, with Sprig's
meaning.
"""

from __future__ import annotations

import base64
import copy
import hashlib
import json
import re
from collections.abc import Callable
from decimal import Decimal
from pathlib import Path
from typing import Any

import yaml


class TemplateError(Exception):
    pass


# ---------------------------------------------------------------------------------------------------------
# lexing and parsing

ACTION = re.compile(r"\{\{(-\s)?(.*?)(\s-)?\}\}", re.S)
TOKEN = re.compile(
    r"""\s*(?:
      (?P<str>"(?:[^"\\]|\\.)*") | (?P<raw>`[^`]*`) |
      (?P<num>-?\d+(?:\.\d+)?(?:[eE][+-]?\d+)?) |
      (?P<decl>:=) | (?P<assign>=) | (?P<pipe>\|) | (?P<lp>\() | (?P<rp>\)) | (?P<comma>,) |
      (?P<var>\$\w*(?:\.\w+)*) | (?P<field>(?:\.\w+)+|\.) | (?P<ident>[A-Za-z_]\w*) )""",
    re.X,
)


def tokenize(src: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    src = src.strip()
    while pos < len(src):
        m = TOKEN.match(src, pos)
        if not m or m.end() == pos:
            raise TemplateError(f"cannot parse {src[pos:]!r} in {{{{{src}}}}}")
        kind = m.lastgroup
        assert kind is not None
        out.append((kind, m.group(kind)))
        pos = m.end()
        while pos < len(src) and src[pos].isspace():
            pos += 1
    return out


class Node:
    kind = ""

    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


def parse(text: str, name: str) -> tuple[list[Node], dict[str, list[Node]]]:
    """A template's nodes and the templates it defines."""
    parts: list[Node] = []
    pos = 0
    for m in ACTION.finditer(text):
        lead = text[pos : m.start()]
        if m.group(1):
            lead = lead.rstrip()
        if lead:
            parts.append(Node(kind="text", text=lead))
        body = m.group(2)
        parts.append(Node(kind="action", body=body, trim_right=bool(m.group(3))))
        pos = m.end()
    tail = text[pos:]
    parts.append(Node(kind="text", text=tail))
    # right trim: whitespace after a `-}}` goes
    for i, p in enumerate(parts[:-1]):
        if p.kind == "action" and p.trim_right and parts[i + 1].kind == "text":
            parts[i + 1].text = parts[i + 1].text.lstrip()
    defines: dict[str, list[Node]] = {}
    stream = iter(parts)

    def block(ends: tuple[str, ...]) -> tuple[list[Node], str, list[tuple[str, str]]]:
        nodes: list[Node] = []
        for p in stream:
            if p.kind == "text":
                if p.text:
                    nodes.append(p)
                continue
            body = p.body.strip()
            if body.startswith("/*"):
                if not body.endswith("*/"):
                    raise TemplateError(f"{name}: unclosed comment")
                continue
            toks = tokenize(body)
            word = toks[0][1] if toks[0][0] == "ident" else ""
            if word in ("end", "else") and word in ends:
                return nodes, word, toks[1:]
            if word in ("if", "with", "range"):
                body_nodes, end, rest = block(("end", "else"))
                else_nodes: list[Node] = []
                while end == "else":
                    if rest and rest[0][1] in ("if", "with"):  # else if / else with: a nested block
                        inner, end, rest2 = block(("end", "else"))
                        nested = Node(kind=rest[0][1], pipe=parse_pipe(rest[1:], name), body=inner, orelse=[])
                        else_nodes = [nested]
                        tail_nodes = nested
                        while end == "else":
                            if rest2 and rest2[0][1] in ("if", "with"):
                                inner, end, rest3 = block(("end", "else"))
                                n2 = Node(
                                    kind=rest2[0][1], pipe=parse_pipe(rest2[1:], name), body=inner, orelse=[]
                                )
                                tail_nodes.orelse = [n2]
                                tail_nodes, rest2 = n2, rest3
                            else:
                                tail_nodes.orelse, end, _ = block(("end",))
                        break
                    else_nodes, end, rest = block(("end",))
                nodes.append(
                    Node(kind=word, pipe=parse_pipe(toks[1:], name), body=body_nodes, orelse=else_nodes)
                )
            elif word == "define":
                tname = literal(toks[1])
                defines[tname], _, _ = block(("end",))
            elif word == "template":
                nodes.append(Node(kind="template", name=literal(toks[1]), pipe=parse_pipe(toks[2:], name)))
            elif word in ("break", "continue"):
                nodes.append(Node(kind=word))
            elif word in ("end", "else", "block"):
                raise TemplateError(f"{name}: unexpected {{{{{body}}}}}")
            else:
                nodes.append(Node(kind="print", pipe=parse_pipe(toks, name)))
        if ends:
            raise TemplateError(f"{name}: missing {{{{end}}}}")
        return nodes, "", []

    top, _, _ = block(())
    return top, defines


def literal(tok: tuple[str, str]) -> str:
    if tok[0] == "str":
        return json.loads(tok[1])
    if tok[0] == "raw":
        return tok[1][1:-1]
    raise TemplateError(f"expected a string, got {tok[1]}")


def parse_pipe(toks: list[tuple[str, str]], name: str) -> Node:
    decl: list[str] = []
    mode = ""
    for i, t in enumerate(toks):
        if t[0] in ("decl", "assign"):
            decl = [v for k, v in toks[:i] if k == "var"]
            mode, toks = t[0], toks[i + 1 :]
            break
        if t[0] not in ("var", "comma"):
            break
    cmds: list[list[Any]] = [[]]
    stack = [cmds]
    for t in toks:
        if t[0] == "lp":
            sub: list[list[Any]] = [[]]
            stack[-1][-1].append(("pipe", sub))
            stack.append(sub)
        elif t[0] == "rp":
            stack.pop()
        elif t[0] == "pipe":
            stack[-1].append([])
        else:
            stack[-1][-1].append(t)
    if len(stack) != 1:
        raise TemplateError(f"{name}: unbalanced parentheses")
    return Node(kind="pipe", decl=decl, mode=mode, cmds=cmds)


# ---------------------------------------------------------------------------------------------------------
# evaluation


class Break(Exception):
    pass


class Continue(Exception):
    pass


def go_str(v: Any) -> str:
    """fmt's %v, as text/template prints a value (nil: "", Helm's replacement of <no value>)."""
    if v is None:
        return ""
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return go_float(v)
    if isinstance(v, list):
        return "[" + " ".join(go_str(x) if x is not None else "<nil>" for x in v) + "]"
    if isinstance(v, dict):
        return "map[" + " ".join(f"{k}:{go_str(v[k])}" for k in sorted(v)) + "]"
    return str(v)


def go_float(f: float) -> str:
    """strconv.FormatFloat(f, 'g', -1, 64): the shortest digits, an exponent from 1e+06 and below 1e-04."""
    if f == 0:
        return "0"
    d = Decimal(repr(f)).normalize()
    sign, digits, exponent = d.as_tuple()
    assert isinstance(exponent, int)
    x = len(digits) + exponent - 1  # the decimal exponent of the first digit
    if x < -4 or x >= 6:
        mantissa = str(digits[0]) + ("." + "".join(map(str, digits[1:])) if len(digits) > 1 else "")
        return f"{'-' if sign else ''}{mantissa}e{'+' if x >= 0 else '-'}{abs(x):02d}"
    return format(d, "f")


def truth(v: Any) -> bool:
    return not (v is None or v is False or v == 0 and not isinstance(v, bool) or v in ("", [], {}))


def kind(v: Any) -> str:
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, int):
        return "int"
    if isinstance(v, float):
        return "float"
    if isinstance(v, str):
        return "string"
    return type(v).__name__


def comparable(a: Any, b: Any, op: str) -> None:
    if a is None or b is None:
        if op != "eq":
            raise TemplateError(f"{op}: invalid type for comparison (nil)")
        return
    if kind(a) != kind(b):
        raise TemplateError(f"{op}: incompatible types for comparison: {kind(a)} {a!r} and {kind(b)} {b!r}")


def eq(a: Any, *bs: Any) -> bool:
    for b in bs:
        comparable(a, b, "eq")
        if a == b:
            return True
    return False


def to_int(v: Any) -> int:
    if v is None:
        return 0
    if isinstance(v, str):
        try:
            return int(float(v))
        except ValueError:
            return 0
    return int(v)


def to_yaml(v: Any) -> str:
    """Helm's toYaml: sigs.k8s.io/yaml (through JSON: integral floats are ints), the last newline cut."""

    def plain(x: Any) -> Any:
        if isinstance(x, float) and x == int(x):
            return int(x)
        if isinstance(x, dict):
            return {str(k): plain(y) for k, y in x.items()}
        if isinstance(x, list):
            return [plain(y) for y in x]
        return x

    if v is None:
        return "null"
    return yaml.safe_dump(plain(v), sort_keys=True, default_flow_style=False, width=10**9).removesuffix("\n")


def indent(n: int, s: str) -> str:
    pad = " " * to_int(n)
    return pad + s.replace("\n", "\n" + pad)


def printf(fmt: str, *args: Any) -> str:
    it = iter(args)

    def verb(m: re.Match) -> str:
        v = m.group(1)
        if v == "%":
            return "%"
        a = next(it)
        if v in ("s", "v"):
            return go_str(a)
        if v == "d":
            return str(int(a))
        if v == "q":
            return json.dumps(go_str(a))
        if v == "t":
            return go_str(bool(a))
        raise TemplateError(f"printf: verb %{v} is not supported here")

    return re.sub(r"%([%sdvqt])", verb, fmt)


def required(msg: str, v: Any) -> Any:
    if v is None or v == "":
        raise TemplateError(f"execution error: {msg}")
    return v


def fail(msg: str) -> None:
    raise TemplateError(f"execution error: {msg}")


def sprig_dict(*kv: Any) -> dict:
    return {go_str(kv[i]): (kv[i + 1] if i + 1 < len(kv) else "") for i in range(0, len(kv), 2)}


FUNCTIONS: dict[str, Callable[..., Any]] = {
    # Go's builtins
    "not": lambda a: not truth(a),
    "eq": eq,
    "ne": lambda a, b: (comparable(a, b, "ne"), a != b)[1],
    "lt": lambda a, b: (comparable(a, b, "lt"), a < b)[1],
    "le": lambda a, b: (comparable(a, b, "le"), a <= b)[1],
    "gt": lambda a, b: (comparable(a, b, "gt"), a > b)[1],
    "ge": lambda a, b: (comparable(a, b, "ge"), a >= b)[1],
    "len": lambda a: len(a),
    "index": lambda a, *ks: _index(a, ks),
    "print": lambda *a: "".join(go_str(x) for x in a),
    "printf": printf,
    # Sprig
    "default": lambda d, v=None: v if truth(v) else d,
    "empty": lambda v: not truth(v),
    "required": required,
    "fail": fail,
    "quote": lambda *a: " ".join(json.dumps(go_str(x)) for x in a if x is not None),
    "squote": lambda *a: " ".join(f"'{go_str(x)}'" for x in a if x is not None),
    "toYaml": to_yaml,
    "toJson": lambda v: json.dumps(v, separators=(",", ":"), sort_keys=True),
    "indent": indent,
    "nindent": lambda n, s: "\n" + indent(n, s),
    "trunc": lambda n, s: s[: to_int(n)] if to_int(n) >= 0 else s[to_int(n) :],
    "trimSuffix": lambda suf, s: s.removesuffix(suf),
    "trimPrefix": lambda pre, s: s.removeprefix(pre),
    "trim": lambda s: s.strip(),
    "replace": lambda old, new, s: s.replace(old, new),
    "lower": lambda s: s.lower(),
    "upper": lambda s: s.upper(),
    "contains": lambda sub, s: sub in s,
    "hasPrefix": lambda pre, s: s.startswith(pre),
    "hasSuffix": lambda suf, s: s.endswith(suf),
    "join": lambda sep, xs: sep.join(go_str(x) for x in (xs or [])),
    "splitList": lambda sep, s: s.split(sep),
    "list": lambda *a: list(a),
    "append": lambda xs, x: [*(xs or []), x],
    "concat": lambda *ls: [x for lst in ls for x in (lst or [])],
    "first": lambda xs: xs[0] if xs else None,
    "dict": sprig_dict,
    "get": lambda d, k: d.get(k, ""),
    "set": lambda d, k, v: (d.__setitem__(k, v), d)[1],
    "deepCopy": copy.deepcopy,
    "hasKey": lambda d, k: k in d,
    "keys": lambda *ds: [k for d in ds for k in d],
    "sortAlpha": lambda xs: sorted(go_str(x) for x in xs),
    "until": lambda n: list(range(to_int(n))),
    "add": lambda *a: sum(to_int(x) for x in a),
    "add1": lambda a: to_int(a) + 1,
    "sub": lambda a, b: to_int(a) - to_int(b),
    "mul": lambda a, b: to_int(a) * to_int(b),
    "int": to_int,
    "int64": to_int,
    "toString": go_str,
    "b64enc": lambda s: base64.b64encode(go_str(s).encode()).decode(),
    "sha256sum": lambda s: hashlib.sha256(go_str(s).encode()).hexdigest(),
    "ternary": lambda a, b, c: a if truth(c) else b,
    "coalesce": lambda *a: next((x for x in a if truth(x)), None),
    "kindIs": lambda k, v: (
        {"map": dict, "slice": list, "string": str, "bool": bool}.get(k, type(None)) is type(v)
        or (k == "float64" and isinstance(v, float))
        or (k == "int" and kind(v) == "int")
    ),
}


def _index(a: Any, keys: tuple) -> Any:
    for k in keys:
        if a is None:
            raise TemplateError("index of untyped nil")
        a = a.get(k) if isinstance(a, dict) else a[to_int(k)]
    return a


class Renderer:
    def __init__(self, templates: dict[str, str]) -> None:
        self.trees: dict[str, list[Node]] = {}
        self.defines: dict[str, list[Node]] = {}
        for name, text in templates.items():
            self.trees[name], defs = parse(text, name)
            self.defines.update(defs)  # Helm: a later file's define replaces an earlier one's
        self.depth = 0

    def render(self, name: str, top: dict) -> str:
        out: list[str] = []
        self.top = top
        self.run(self.trees[name], top, [["$", top]], out)
        return "".join(out)

    def include(self, name: str, dot: Any) -> str:
        if name not in self.defines:
            raise TemplateError(f'include: no template "{name}" associated with template')
        self.depth += 1
        if self.depth > 100:
            raise TemplateError(f"include: {name} nests too deep")
        out: list[str] = []
        try:
            self.run(self.defines[name], dot, [["$", dot]], out)
        finally:
            self.depth -= 1
        return "".join(out)

    def run(self, nodes: list[Node], dot: Any, scope: list[list[Any]], out: list[str]) -> None:
        for n in nodes:
            mark = len(scope)
            if n.kind == "text":
                out.append(n.text)
            elif n.kind == "print":
                v = self.pipe(n.pipe, dot, scope)
                if not n.pipe.decl:
                    out.append(go_str(v))
                continue  # a declaration lives to the end of the enclosing block
            elif n.kind == "if":
                branch = n.body if truth(self.pipe(n.pipe, dot, scope)) else n.orelse
                self.run(branch, dot, scope, out)
            elif n.kind == "with":
                v = self.pipe(n.pipe, dot, scope)
                if truth(v):
                    self.run(n.body, v, scope, out)
                else:
                    self.run(n.orelse, dot, scope, out)
            elif n.kind == "range":
                decl, n.pipe.decl = n.pipe.decl, []
                try:
                    v = self.pipe(n.pipe, dot, scope)
                finally:
                    n.pipe.decl = decl
                items = sorted(v.items()) if isinstance(v, dict) else list(enumerate(v or []))
                if isinstance(v, int | float) and not isinstance(v, bool):
                    raise TemplateError("range over a number: use until")
                if not items:
                    self.run(n.orelse, dot, scope, out)
                for k, item in items:
                    inner = len(scope)
                    if len(decl) == 1:
                        scope.append([decl[0], item])
                    elif len(decl) == 2:
                        scope.extend([[decl[0], k], [decl[1], item]])
                    try:
                        self.run(n.body, item, scope, out)
                    except Break:
                        break
                    except Continue:
                        pass
                    finally:
                        del scope[inner:]
            elif n.kind == "template":
                arg = self.pipe(n.pipe, dot, scope) if n.pipe.cmds[0] else None
                out.append(self.include(n.name, arg))
            elif n.kind == "break":
                raise Break
            elif n.kind == "continue":
                raise Continue
            del scope[mark:]

    def pipe(self, p: Node, dot: Any, scope: list[list[Any]]) -> Any:
        v: Any = None
        for i, cmd in enumerate(p.cmds):
            v = self.command(cmd, dot, scope, [v] if i else [])
        if p.decl:
            if p.mode == "decl":
                scope.append([p.decl[-1], v])
            else:
                for cell in reversed(scope):
                    if cell[0] == p.decl[-1]:
                        cell[1] = v
                        break
                else:
                    raise TemplateError(f"undefined variable: {p.decl[-1]}")
        return v

    def command(self, cmd: list, dot: Any, scope: list[list[Any]], piped: list) -> Any:
        if not cmd:
            raise TemplateError("empty command")
        head, rest = cmd[0], cmd[1:]
        if head[0] == "ident" and head[1] not in ("true", "false", "nil"):
            name = head[1]
            args = [self.operand(a, dot, scope) for a in rest] + piped
            if name == "and":
                return next((a for a in args if not truth(a)), args[-1])
            if name == "or":
                return next((a for a in args if truth(a)), args[-1])
            if name == "include":
                return self.include(args[0], args[1] if len(args) > 1 else None)
            if name == "tpl":
                return Renderer({"tpl": args[0]}).render("tpl", args[1])
            fn = FUNCTIONS.get(name)
            if fn is None:
                raise TemplateError(f'function "{name}" not defined')
            try:
                return fn(*args)
            except TemplateError:
                raise
            except Exception as e:
                raise TemplateError(f"error calling {name}: {e}") from e
        v = self.operand(head, dot, scope)
        args = [self.operand(a, dot, scope) for a in rest] + piped
        if callable(v):
            return v(*args)
        if args:
            raise TemplateError(f"{head[1]} is not a function: cannot give it arguments")
        return v

    def operand(self, tok: Any, dot: Any, scope: list[list[Any]]) -> Any:
        k, s = tok
        if k == "pipe":
            return self.pipe(Node(kind="pipe", decl=[], mode="", cmds=s), dot, scope)
        if k in ("str", "raw"):
            return literal(tok)
        if k == "num":
            return float(s) if re.search(r"[.eE]", s) else int(s)
        if k == "ident":
            if s in ("true", "false"):
                return s == "true"
            if s == "nil":
                return None
            return self.command([tok], dot, scope, [])
        if k == "field":
            return self.fields(dot, s.split(".")[1:] if s != "." else [], s)
        if k == "var":
            name, *path = s.split(".")
            for cell in reversed(scope):
                if cell[0] == name:
                    return self.fields(cell[1], path, s)
            raise TemplateError(f"undefined variable: {name}")
        raise TemplateError(f"unexpected {s!r}")

    @staticmethod
    def fields(v: Any, path: list[str], what: str) -> Any:
        for f in path:
            if v is None:
                raise TemplateError(f"nil pointer evaluating interface {{}}.{f} ({what})")
            if not isinstance(v, dict):
                raise TemplateError(f"can't evaluate field {f} in type {kind(v)} ({what})")
            v = v.get(f)
        return v


# ---------------------------------------------------------------------------------------------------------
# a chart, as `helm template` renders it


def floats(v: Any) -> Any:
    """Values as Helm holds them: read through JSON, every number a float64."""
    if isinstance(v, bool) or v is None or isinstance(v, str):
        return v
    if isinstance(v, int | float):
        return float(v)
    if isinstance(v, dict):
        return {k: floats(x) for k, x in v.items()}
    if isinstance(v, list):
        return [floats(x) for x in v]
    return v


def coalesce(base: dict, over: dict) -> dict:
    """Helm's coalescing of values: maps merge, anything else replaces, null deletes the key."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = coalesce(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


SPLIT = re.compile(r"(?:^|\s*\n)---\s*")


def render_chart(
    chart: Path,
    values_files: list[Path] = (),  # type: ignore[assignment]
    release: str = "run",
    namespace: str = "default",
    api_versions: tuple[str, ...] = (),
    extra_values: dict | None = None,
) -> tuple[dict[str, list[dict]], str]:
    """Every template's YAML documents (name -> objects) and NOTES.txt, as `helm template RELEASE CHART -f
    FILE... --namespace NAMESPACE --api-versions V...` would print them."""
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    values = yaml.safe_load((chart / "values.yaml").read_text()) or {}
    for f in values_files:
        values = coalesce(values, yaml.safe_load(Path(f).read_text()) or {})
    if extra_values:
        values = coalesce(values, extra_values)
    templates = {
        str(p.relative_to(chart)): p.read_text()
        for p in sorted((chart / "templates").rglob("*"))
        if p.is_file()
    }
    files = {str(p.relative_to(chart)): p.read_text() for p in chart.rglob("*") if p.is_file()}
    renderer = Renderer(templates)
    top = {
        "Values": floats(values),
        "Release": {
            "Name": release,
            "Namespace": namespace,
            "Service": "Helm",
            "IsInstall": True,
            "Revision": 1,
        },
        "Chart": {k[0].upper() + k[1:]: v for k, v in meta.items()},
        "Capabilities": {
            "APIVersions": {"Has": lambda v: v in api_versions},
            "KubeVersion": {"Version": "v1.31.0", "Major": "1", "Minor": "31"},
        },
        "Files": {"Get": lambda name: files.get(name, "")},
        "Template": {"BasePath": f"{meta['name']}/templates"},
    }
    out: dict[str, list[dict]] = {}
    notes = ""
    for name in templates:
        base = Path(name).name
        if base.startswith("_"):
            continue
        top["Template"]["Name"] = f"{meta['name']}/{name}"
        try:
            text = renderer.render(name, top)
        except TemplateError as e:
            raise TemplateError(f"{name}: {e}") from None
        if base == "NOTES.txt":
            notes = text
            continue
        docs = []
        for part in SPLIT.split(text):
            if not part.strip():
                continue
            try:
                obj = yaml.safe_load(part)
            except yaml.YAMLError as e:
                raise TemplateError(f"{name}: the output is not YAML: {e}\n{part}") from None
            if obj is not None:
                docs.append(obj)
        out[name] = docs
    return out, notes
