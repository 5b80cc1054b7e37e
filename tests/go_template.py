"""A renderer of the Go ``text/template`` subset Ollama's chat TEMPLATEs use, for the tests of the exported
``Modelfile``: text and ``{{ }}`` actions (``{{-``/``-}}`` trimming), ``range $i, $m := PIPE``, ``if``/``else if``/
``else``/``end``, ``$var := PIPE``, fields (``.Messages``, ``$.Messages``, ``$m.Role``, ``.Content``), string and
integer literals, parentheses, and the builtins ``eq ne and or not len slice index``. Rendered with Ollama's data for
the messages form: ``{"Messages": [{"Role", "Content"}, ...], "System": ..., ...}``. Anything else raises
``ValueError``: the tests must fail on syntax this renderer does not know rather than guess."""

from __future__ import annotations

import re

_ACTION = re.compile(r"\{\{(-?)\s*(.*?)\s*(-?)\}\}", re.S)
_TOKEN = re.compile(r'\s*(\(|\)|"(?:[^"\\]|\\.)*"|[^\s()]+)')


def _tokens(text: str) -> list[str]:
    tokens, pos = [], 0
    while pos < len(text):
        match = _TOKEN.match(text, pos)
        if not match:
            break
        tokens.append(match.group(1))
        pos = match.end()
    return tokens


def _parse(template: str) -> list:
    """A list of nodes: ("text", s), ("out", expr), ("set", name, expr), ("if", [(cond, body)...], else_body),
    ("range", index_var, value_var, expr, body)."""
    pieces, pos = [], 0
    for match in _ACTION.finditer(template):
        text = template[pos:match.start()]
        if match.group(1):
            text = text.rstrip()
        if pieces and pieces[-1][0] == "trim-next":
            pieces.pop()
            text = text.lstrip()
        pieces.append(("text", text))
        pieces.append(("action", match.group(2).strip()))
        if match.group(3):
            pieces.append(("trim-next",))
        pos = match.end()
    tail = template[pos:]
    if pieces and pieces[-1][0] == "trim-next":
        pieces.pop()
        tail = tail.lstrip()
    pieces.append(("text", tail))
    nodes, rest = _block(pieces, 0, top=True)
    return nodes


def _block(pieces: list, i: int, top: bool = False):
    nodes = []
    while i < len(pieces):
        kind = pieces[i][0]
        if kind == "text":
            nodes.append(("text", pieces[i][1]))
            i += 1
            continue
        action = pieces[i][1]
        words = action.split()
        if words[0] in ("end", "else"):
            if top:
                raise ValueError(f"unexpected {{{{ {action} }}}}")
            return nodes, i
        if words[0] == "if":
            node, i = _if_node(pieces, i, action)
            nodes.append(node)
            continue
        if words[0] == "range":
            match = re.fullmatch(r"range\s+(\$\w+)\s*,\s*(\$\w+)\s*:=\s*(.+)", action, re.S)
            if not match:
                raise ValueError(f"unsupported range: {action!r}")
            body, i = _block(pieces, i + 1)
            if pieces[i][1] != "end":
                raise ValueError("range with else is not supported")
            nodes.append(("range", match.group(1), match.group(2), _expr(_tokens(match.group(3))), body))
            i += 1
            continue
        match = re.fullmatch(r"(\$\w+)\s*:=\s*(.+)", action, re.S)
        if match:
            nodes.append(("set", match.group(1), _expr(_tokens(match.group(2)))))
        else:
            nodes.append(("out", _expr(_tokens(action))))
        i += 1
    if not top:
        raise ValueError("missing {{ end }}")
    return nodes, i


def _if_node(pieces: list, i: int, action: str):
    """The ("if", branches, else body) node opened by ``pieces[i]``, and the index after its ``end``."""
    branches, otherwise = [], []
    cond = action[2:].strip()
    while True:
        body, i = _block(pieces, i + 1)
        branches.append((cond, body))
        closing = pieces[i][1]
        if closing == "end":
            break
        if closing.startswith("else if "):
            cond = closing[len("else if "):]
            continue
        if closing == "else":
            otherwise, i = _block(pieces, i + 1)
            if pieces[i][1] != "end":
                raise ValueError("else without end")
            break
        raise ValueError(f"unexpected {{{{ {closing} }}}}")
    return ("if", [(_expr(_tokens(c)), b) for c, b in branches], otherwise), i + 1


def _expr(tokens: list[str]):
    """A command: a function applied to operands, or a single operand."""
    items, i = [], 0
    while i < len(tokens):
        if tokens[i] == "(":
            depth, j = 1, i + 1
            while depth:
                depth += {"(": 1, ")": -1}.get(tokens[j], 0)
                j += 1
            items.append(_expr(tokens[i + 1:j - 1]))
            i = j
        else:
            items.append(("atom", tokens[i]))
            i += 1
    if len(items) == 1:
        return items[0]
    return ("call", items[0][1], items[1:])


FUNCTIONS = {
    "eq": lambda a, *b: any(a == x for x in b),
    "ne": lambda a, b: a != b,
    "not": lambda a: not _truth(a),
    "len": len,
    "slice": lambda seq, *ix: seq[ix[0]:ix[1]] if len(ix) == 2 else seq[ix[0]:] if ix else seq,
    "index": lambda seq, i: seq[i],
}


def _truth(value) -> bool:
    return bool(value)


def _value(node, dot, scope: dict, root):
    if node[0] == "call":
        return _call(node[1], node[2], dot, scope, root)
    token = node[1]
    if token.startswith('"'):
        return bytes(token[1:-1], "utf-8").decode("unicode_escape")
    if re.fullmatch(r"-?\d+", token):
        return int(token)
    if token in ("true", "false"):
        return token == "true"
    if token.startswith("$"):
        name, _, fields = token.partition(".")
        value = root if name == "$" else scope[name]
        return _fields(value, fields)
    if token.startswith("."):
        return _fields(dot, token[1:])
    raise ValueError(f"unsupported operand {token!r}")


def _call(name: str, args: list, dot, scope: dict, root):
    """A function call; ``and``/``or`` evaluate lazily and return an operand, as Go's do."""
    if name in ("and", "or"):
        value = name == "and"
        for arg in args:
            value = _value(arg, dot, scope, root)
            if _truth(value) != (name == "and"):
                return value
        return value
    if name not in FUNCTIONS:
        raise ValueError(f"unsupported function {name!r}")
    return FUNCTIONS[name](*(_value(a, dot, scope, root) for a in args))


def _fields(value, path: str):
    for field in filter(None, path.split(".")):
        value = value[field]
    return value


def _run(nodes: list, dot, scope: dict, root, out: list) -> None:
    scope = dict(scope)
    for node in nodes:
        kind = node[0]
        if kind == "text":
            out.append(node[1])
        elif kind == "out":
            out.append(str(_value(node[1], dot, scope, root)))
        elif kind == "set":
            scope[node[1]] = _value(node[2], dot, scope, root)
        elif kind == "if":
            for cond, body in node[1]:
                if _truth(_value(cond, dot, scope, root)):
                    _run(body, dot, scope, root, out)
                    break
            else:
                _run(node[2], dot, scope, root, out)
        elif kind == "range":
            for i, item in enumerate(_value(node[3], dot, scope, root)):
                _run(node[4], item, {**scope, node[1]: i, node[2]: item}, root, out)


def render(template: str, data: dict) -> str:
    """``template`` executed on ``data`` (dot and ``$`` are ``data``)."""
    out: list[str] = []
    _run(_parse(template), data, {}, data, out)
    return "".join(out)


def ollama_render(template: str, messages: list[dict]) -> str:
    """What Ollama renders for a chat of ``messages`` (``{"role", "content"}``) with a messages-form TEMPLATE."""
    data = {"Messages": [{"Role": m["role"], "Content": m["content"]} for m in messages], "System": "", "Tools": None}
    return render(template, data)
