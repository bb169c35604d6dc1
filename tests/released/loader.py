"""Load a few modules of an engine's released sources without installing the engine or its heavy dependencies.

An :class:`EngineCode` imports the named modules of one release from its unpacked sources (``sources.py``)
under the engine's own package name (``vllm``, ``sglang``), so their absolute imports of each other work
unchanged. Every other module of the engine's package that they import is a *stub*: an empty module whose
attributes are placeholder classes, unless the caller hands over a stub's contents (a real value where the code
uses one at import or call time). Package ``__init__`` files are not run (vLLM's and SGLang's import torch).
A module may also be built from a few top-level definitions of its source file (``partial``): the engine's own
function, without its module's other imports.

Isolation: the engine's modules live in ``sys.modules`` only inside :meth:`EngineCode.active`; outside it
(and before it is first entered) ``sys.modules`` holds none of them, so two versions of one engine, or this
and any other test, never see each other's modules. Code that imports lazily at call time must be called
inside ``active()``.
"""

from __future__ import annotations
import __future__

import ast
import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any, cast

from pydantic_core import core_schema


class _PlaceholderMeta(type):
    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return _placeholder(f"{cls.__name__}.{name}")

    def __getitem__(cls, item: Any) -> Any:
        return cls

    def __get_pydantic_core_schema__(cls, source: Any, handler: Any) -> Any:
        return core_schema.any_schema()  # a field typed with a placeholder takes anything


class Placeholder(metaclass=_PlaceholderMeta):
    """What a stub module hands out for a name nobody gave it: a class (usable as a base, an annotation in a
    ``TYPE_CHECKING`` block, an ``isinstance`` target that matches nothing) whose instances accept anything."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self


def _placeholder(name: str) -> type[Placeholder]:
    return cast(type[Placeholder], _PlaceholderMeta(name.rsplit(".", 1)[-1], (Placeholder,), {"__qualname__": name}))


class _StubModule(ModuleType):
    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        value = _placeholder(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value


class _Loader(importlib.abc.Loader):
    def __init__(self, code: EngineCode) -> None:
        self.code = code

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _StubModule(spec.name)
        module.__path__ = []  # a package: its submodules are stubs too, unless named real
        module.__dict__.update(self.code.stubs.get(spec.name, {}))
        partial = self.code.partial.get(spec.name)
        if partial is not None:
            module.__file__ = str(self.code.file_of(spec.name))
        return module

    def exec_module(self, module: ModuleType) -> None:
        partial = self.code.partial.get(module.__name__)
        if partial is not None:
            _exec_definitions(Path(module.__file__ or ""), partial, module)


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, code: EngineCode) -> None:
        self.code = code

    def find_spec(self, name: str, path: Sequence[str] | None, target: ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if not self.code.owns(name):
            return None
        if name in self.code.real:
            file = self.code.file_of(name)
            return importlib.util.spec_from_file_location(name, file)
        return importlib.machinery.ModuleSpec(name, _Loader(self.code), is_package=True)


class EngineCode:
    """Modules ``real`` of the engine package ``top`` unpacked under ``root``, the rest of the package stubbed.

    ``stubs``: module name -> names to put in that stub module. ``partial``: module name -> top-level functions
    or classes (``Class.method`` for a method, defined as a plain function) taken from that module's source.
    ``external``: modules outside the engine's package to stand in for ones not installed here (``regex``, whose
    superset of ``re`` the loaded code does not use)."""

    def __init__(self, root: Path, top: str, real: Iterable[str], stubs: Mapping[str, Mapping[str, Any]] = {},
                 partial: Mapping[str, Sequence[str]] = {}, external: Mapping[str, ModuleType] = {}) -> None:
        self.root, self.top = root, top
        self.external = dict(external)
        self.real = frozenset(real)
        self.stubs = {name: dict(values) for name, values in stubs.items()}
        self.partial = {name: tuple(defs) for name, defs in partial.items()}
        self._modules: dict[str, ModuleType] = {}
        self._finder = _Finder(self)

    def owns(self, name: str) -> bool:
        return name == self.top or name.startswith(self.top + ".")

    def file_of(self, name: str) -> Path:
        base = self.root.joinpath(*name.split("."))
        return base.with_suffix(".py") if base.with_suffix(".py").exists() else base / "__init__.py"

    @contextmanager
    def active(self) -> Iterator[EngineCode]:
        """The engine's modules in ``sys.modules`` (and importable) for the duration; whatever was there under
        its package name before is put back afterwards."""
        saved = {name: module for name, module in sys.modules.items() if self.owns(name) or name in self.external}
        for name in saved:
            del sys.modules[name]
        sys.modules.update(self._modules)
        sys.modules.update(self.external)
        sys.meta_path.insert(0, self._finder)
        try:
            yield self
        finally:
            sys.meta_path.remove(self._finder)
            for name in [name for name in sys.modules if self.owns(name)]:
                self._modules[name] = sys.modules.pop(name)
            for name in self.external:
                sys.modules.pop(name, None)
            sys.modules.update(saved)

    def module(self, name: str) -> ModuleType:
        with self.active():
            return importlib.import_module(name)


def _exec_definitions(file: Path, names: Sequence[str], module: ModuleType) -> None:
    """Run the file's top-level imports that succeed, then only the named definitions, into ``module``."""
    tree = ast.parse(file.read_text(), str(file))
    wanted: list[ast.stmt] = []
    for name in names:
        outer, _, inner = name.partition(".")
        found = next((node for node in tree.body
                      if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == outer), None)
        if found is not None and inner:
            assert isinstance(found, ast.ClassDef)
            found = next((node for node in found.body if isinstance(node, ast.FunctionDef) and node.name == inner),
                         None)
        if found is None:
            raise LookupError(f"{file} defines no {name}")
        wanted.append(found)
    for node in tree.body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            # (what the wanted definitions need is imported here; a missing one fails when they run)
            with contextlib.suppress(ImportError):
                exec(compile(ast.Module([node], []), str(file), "exec"), module.__dict__)
    future = any(isinstance(node, ast.ImportFrom) and node.module == "__future__"
                 and any(alias.name == "annotations" for alias in node.names) for node in tree.body)
    flags = __future__.annotations.compiler_flag if future else 0
    exec(compile(ast.Module(wanted, []), str(file), "exec", flags=flags, dont_inherit=True), module.__dict__)
