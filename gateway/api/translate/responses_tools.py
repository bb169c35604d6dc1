"""Responses ``tools`` -> chat ``tools``, and the names the model calls them by back to the client's.

Only function tools have a chat form. A ``namespace`` (``{"type": "namespace", "name", "description",
"tools": [function tools]}``: Codex groups its sub-agent tools as ``multi_agent_v1``) is a grouping the model
never sees on OpenAI either: its function tools are offered flat, each under its qualified name
``<namespace>__<name>`` (so two namespaces, or a namespace and a top-level tool, may use the same name), and
a call of a qualified name comes back as the client expects it, a ``function_call`` item with the tool's own
``name`` and its ``namespace``. A client sending such a call back as input (with ``namespace``) gets it
qualified again, so the model sees the names it was offered.

A built-in tool (``web_search``, ``file_search``, ``code_interpreter``, ``mcp``, ...) runs on OpenAI's
servers; no engine has one. ``web_search`` is an offer the model may leave unused, and Codex sends it by
default (with its defaults, every Codex request was refused): it is not offered to the model, and the answer
says so (``x-gateway-tools-omitted``, :func:`omitted`); a ``tool_choice`` that forces it is refused. Every other
built-in tool is refused, the error saying how the client can leave it out.
"""

from __future__ import annotations

import re
from typing import Any

from gateway.errors import GatewayError

SEPARATOR = "__"  # (function names allow [a-zA-Z0-9_-]: a dot or a slash would not be a valid chat name)

# built-in tools left out rather than refused: offers a model may leave unused, which a common client makes by
# default (Codex: web_search)
OMITTED = ("web_search", "web_search_preview")


# its type exactly, or a dated version of it (web_search_preview_2025_03_11): a type is echoed in a response header,
# and a prefix match let a tenant put a line break there (sweep 9)
_OMITTED_TYPE = re.compile(r"(?:" + "|".join(OMITTED) + r")(?:_\d{4}_\d{2}_\d{2})?")


def omitted(tools: Any) -> list[str]:
    """The built-in tools of ``tools`` that are not offered to the model (``OMITTED``), once each, in order."""
    kinds: dict[str, None] = {}
    for tool in tools if isinstance(tools, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and is_omitted(kind):
            kinds[kind] = None
    return list(kinds)


def is_omitted(kind: Any) -> bool:
    """Whether a tool of type ``kind`` is a built-in tool left out (``OMITTED``, dated versions included)."""
    return isinstance(kind, str) and _OMITTED_TYPE.fullmatch(kind) is not None


def _refuse(param: str, message: str, code: str = "unsupported_field") -> GatewayError:
    return GatewayError(400, message, type="invalid_request_error", param=param, code=code)


def qualified(namespace: str, name: str) -> str:
    return f"{namespace}{SEPARATOR}{name}"


def _function(tool: dict[str, Any], param: str, name: str) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name}
    for key, value in tool.items():
        if key in ("description", "parameters", "strict"):
            if value is not None:
                function[key] = value
        # defer_loading: a hint for OpenAI's tool search; without it every tool is offered, which is what
        # the model sees here anyway
        elif key not in ("type", "name", "defer_loading") and value not in (None, False, ["direct"]):
            raise _refuse(f"{param}.{key}", f"'{param}.{key}': this function tool option is not supported by "
                                            "this gateway's Responses API translation; leave it out")
    return {"type": "function", "function": function}


def _name(tool: dict[str, Any], param: str) -> str:
    name = tool.get("name")
    if not isinstance(name, str) or not name:
        raise _refuse(f"{param}.name", f"'{param}.name' must be a non-empty string", "invalid_value")
    return name


def _built_in(kind: Any, param: str) -> GatewayError:
    return _refuse(param, f"'{param}': the built-in tool {kind!r} is not supported by this gateway (only function "
                          "tools, and namespaces of them, are served); leave it out of 'tools'")


def chat_tools(tools: Any) -> list[dict[str, Any]]:
    """The request's ``tools`` as chat tools: function tools as they are, a namespace's flattened under qualified
    names. A 400 naming the tool for a built-in tool, or a qualified name that collides with another tool's."""
    if not isinstance(tools, list):
        raise _refuse("tools", "'tools' must be a list", "invalid_value")
    out: list[dict[str, Any]] = []
    seen: dict[str, str] = {}  # chat name -> where it came from

    def add(tool: dict[str, Any], param: str, name: str) -> None:
        if name in seen:
            raise _refuse(f"{param}.name", f"'{param}' is offered to the model as {name!r}, as is '{seen[name]}': "
                                           "rename one of them", "invalid_value")
        seen[name] = param
        out.append(_function(tool, param, name))

    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind == "function":
            assert isinstance(tool, dict)
            add(tool, param, _name(tool, param))
        elif kind == "namespace":
            assert isinstance(tool, dict)
            namespace = _name(tool, param)
            members = tool.get("tools")
            if not isinstance(members, list):
                raise _refuse(f"{param}.tools", f"'{param}.tools' must be a list", "invalid_value")
            for j, member in enumerate(members):
                where = f"{param}.tools[{j}]"
                if not isinstance(member, dict) or member.get("type") != "function":
                    kind = member.get("type") if isinstance(member, dict) else None
                    raise _refuse(where, f"'{where}': a {kind!r} tool in a namespace is not supported by this "
                                         "gateway (only function tools are served); leave it out")
                add(member, where, qualified(namespace, _name(member, where)))
        elif not (isinstance(kind, str) and is_omitted(kind)):
            raise _built_in(kind, param)
    return out


def namespaced(request: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Each qualified name the model was offered -> (namespace, the tool's own name)."""
    names: dict[str, tuple[str, str]] = {}
    for tool in request.get("tools") or ():
        if isinstance(tool, dict) and tool.get("type") == "namespace" and isinstance(tool.get("name"), str):
            for member in tool.get("tools") or ():
                if isinstance(member, dict) and isinstance(member.get("name"), str):
                    names[qualified(tool["name"], member["name"])] = (tool["name"], member["name"])
    return names


def call_name(names: dict[str, tuple[str, str]], name: str) -> dict[str, str]:
    """The ``name`` (and ``namespace``) fields of a function_call item for the chat tool name ``name``."""
    found = names.get(name)
    return {"name": name} if found is None else {"name": found[1], "namespace": found[0]}


def echoed(request: dict[str, Any]) -> list[dict[str, Any]]:
    """The request's tools as a Response lists them (function tools with every field; namespaces as sent)."""
    out: list[dict[str, Any]] = []
    for tool in request.get("tools") or ():
        if not isinstance(tool, dict):
            continue
        if tool.get("type") == "namespace":
            out.append(tool)
        else:
            out.append({"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                        "parameters": tool.get("parameters"), "strict": tool.get("strict")})
    return out
