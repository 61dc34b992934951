"""The artifact cache: captures kept on disk, so a second process running the same program
skips capture (``kiln.counters.captures == 0``; ``artifact_hits`` counts entries reused).

One file per code object and compile options, ``<cache_dir>/artifacts/<key>.kart``, the key
hashing the code (bytecode, constants, names, nested code), the options and the Kiln, torch,
Triton and Python versions and the device. It holds every entry captured for that code, each
as two pickles: its guards, and the rest (the head function's source and globals, the graphs
as captured, breaks). Objects that only mean something in one process are stored as what they
mean (:class:`_Pickler`) and bound again on the first call of the new process::

    Identity(L['self'], <MLP at 0x7f..>)      ->  ("at", L['self'], MLP)   the object there now,
                                                                           if it is an MLP
    a closure cell of a pinned function       ->  ("at", G['f'].__closure__[0], cell)
    Identity(G['F'], torch.nn.functional)     ->  ("module", "torch.nn.functional")
    a module's globals (a head writes there)  ->  ("module globals", "transformers.utils")
    a function or class                       ->  ("named", module, qualname, digest of its code)
    GraphRunner(graph)                        ->  ("graph", graph as captured): the pipeline
                                                  compiles it again (kernels come from the disk)
    ResumeTarget(code)                        ->  ("resume", key of its code, code, compiled)

A stored entry is used only if every object binds (same module, same class source, same
type at the same path, objects distinct at capture still distinct) and its guards then pass on
the call's values; anything else is a miss and capture runs as usual. Objects of any other
type make an entry uncacheable (logged under ``KILN_LOG=cache``). Files are written to a
temporary name and renamed (concurrent processes see whole files), carry a sha256 of their
contents (a damaged file is removed with a warning and rebuilt) and are evicted least
recently used first past ``config.artifact_cache_bytes``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import hashlib
import importlib
import importlib.metadata
import io
import marshal
import os
import pickle
import platform
import sys
import types
from pathlib import Path
from typing import Any

import torch

from kiln.capture.calls.routing import Router
from kiln.capture.driver.convert import Capture, GraphRunner, param_names
from kiln.capture.driver.resume import ResumeTarget
from kiln.capture.guards.guards import Guard, Identity, compile_guards
from kiln.capture.guards.probing import probe
from kiln.capture.guards.sources import Attr, Binder, Item, Source
from kiln.checked_files import read_checked, write_checked
from kiln.code_cache import compiled as compiled_code
from kiln.config import config, logger

_log = logger("cache")
MAGIC = b"KART1\n"
# Entries kept per file, newest first (one code object shared by many programs, such as a
# compiled module's call, would otherwise gather every model a machine ever ran).
MAX_ENTRIES = 16
_CODE_KEYS: dict[int, tuple[types.CodeType, str]] = {}  # resume codes loaded -> their keys
_BY_VALUE: tuple[type, ...] = (int, float, bool, str, bytes, complex, type(None), tuple, list)
_BY_VALUE += (dict, set, frozenset, slice, range, enum.Enum, torch.dtype, torch.device)
_BY_VALUE += (torch.Size, torch.layout, torch.memory_format, type(Ellipsis))
_BY_VALUE += (torch.storage.TypedStorage, torch.UntypedStorage)  # (a constant tensor's)
# Callables pickle stores by reference (module and name), checked when stored.
_BY_REFERENCE: tuple[type, ...] = (types.BuiltinFunctionType, types.MethodDescriptorType)
_BY_REFERENCE += (types.WrapperDescriptorType, types.ClassMethodDescriptorType)


_TYPES = {value: name for name, value in vars(types).items() if isinstance(value, type)}


class Uncacheable(Exception):
    """An entry holds something that cannot be described as data."""


class Mismatch(Exception):
    """A stored entry does not fit this process (an object is gone, or differs)."""


def code_digest(code: types.CodeType) -> str:
    """sha256 of what ``code`` does: bytecode, constants (nested code by its digest), names,
    flags, argument counts, name and file (``marshal`` output varies with reference counts)."""
    digest = hashlib.sha256()
    parts: list[Any] = [code.co_code, code.co_names, code.co_varnames, code.co_freevars]
    parts += [code.co_cellvars, code.co_flags, code.co_argcount, code.co_kwonlyargcount]
    parts += [code.co_posonlyargcount, code.co_qualname, code.co_filename, code.co_firstlineno]
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            parts.append(code_digest(const))
        else:  # (a frozenset's order varies with the process's string hashing)
            text = sorted(map(repr, const)) if type(const) is frozenset else const
            parts.append((type(const).__name__, repr(text)))
    digest.update(repr(parts).encode())
    return digest.hexdigest()


def _fingerprint(obj: Any) -> str:
    """A function's code and defaults, or a class's functions along its MRO: what capture
    relied on when it inlined them."""
    if isinstance(obj, types.FunctionType):
        return code_digest(obj.__code__) + _stable((obj.__defaults__, obj.__kwdefaults__))
    if not isinstance(obj, type):
        return ""
    known = _FINGERPRINTS.get(obj)
    if known is None:
        parts = []
        for cls in obj.__mro__:  # (torch's own classes are pinned by its version in the key)
            if cls.__module__.partition(".")[0] in ("torch", "builtins"):
                continue
            for name, member in vars(cls).items():
                member = getattr(member, "__func__", getattr(member, "fget", member))
                if isinstance(member, types.FunctionType):
                    parts.append(f"{cls.__qualname__}.{name}:{_fingerprint(member)}")
                elif isinstance(member, (int, float, str, bool, tuple)):
                    parts.append(f"{cls.__qualname__}.{name}={_stable(member)}")
        known = _FINGERPRINTS[obj] = hashlib.sha256("\n".join(parts).encode()).hexdigest()
    return known


_FINGERPRINTS: dict[Any, str] = {}


def _stable(value: Any) -> str:
    """``repr(value)`` without the addresses of objects (functions and classes by name)."""
    if type(value) in (tuple, list):
        return "(" + ", ".join(map(_stable, value)) + ")"
    if type(value) is dict:
        return "{" + ", ".join(f"{_stable(k)}: {_stable(v)}" for k, v in value.items()) + "}"
    if probe(value, "__qualname__") is not None:
        return f"{probe(value, '__module__', '')}.{value.__qualname__}"
    text = repr(value)
    return type(value).__qualname__ if " at 0x" in text else text


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


class _Pickler(pickle.Pickler):
    """Pickles an entry's objects as data: by value only for the types of ``_BY_VALUE``
    and Kiln's own data classes, by meaning for the rest, or refuses (:class:`Uncacheable`)."""

    def __init__(self, file: Any, fn: types.FunctionType, at: dict[int, Source]) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.fn = fn
        self.at = at  # id of each object an identity guard pins -> where it was read
        self.named: dict[int, tuple[str, ...]] = {}  # id of a function or class -> its name

    def persistent_id(self, obj: Any) -> Any:
        if _is_data(type(obj)):  # (most of an entry's 400,000 objects: decided by type)
            return ("at", self.at[id(obj)], _kind(obj)) if id(obj) in self.at else None
        if obj is self.fn.__globals__:
            return ("globals",)
        if isinstance(obj, types.ModuleType):
            return ("module", obj.__name__)
        if type(obj) is dict and _module_of(obj) is not None:
            return ("module globals", obj["__name__"])
        if isinstance(obj, _BY_REFERENCE):
            return None
        if isinstance(obj, (types.FunctionType, type)):  # by name, else where it was read
            if id(obj) in self.named:  # (each pickled object's class comes here: 30,000)
                return self.named[id(obj)]
            module, name = getattr(obj, "__module__", None), obj.__qualname__
            if module == "builtins" and obj in _TYPES:  # (CodeType, CellType, ...)
                module, name = "types", _TYPES[obj]
            with contextlib.suppress(Exception):
                if module is not None and _resolve(module, name) is obj:
                    found = self.named[id(obj)] = ("named", module, name, _fingerprint(obj))
                    return found
            if id(obj) not in self.at:
                raise Uncacheable(f"{obj!r} cannot be found by its name")
        if id(obj) in self.at:
            return ("at", self.at[id(obj)], _kind(obj))
        if isinstance(obj, GraphRunner) and obj.captured is not None:
            return ("graph", obj.captured)
        if isinstance(obj, ResumeTarget):
            return ("resume", key_of(obj.code), marshal.dumps(obj.code), obj.router is not None)
        if isinstance(obj, Router):
            return ("router",)
        if isinstance(obj, types.CodeType):
            return ("code", marshal.dumps(obj))
        if type(obj) is torch.Tensor or isinstance(obj, _BY_VALUE):
            return None
        owner = _class_cell_owner(obj)
        if owner is not None:  # a method's ``__class__`` cell (zero-argument ``super()``)
            return ("class cell", owner.__module__, owner.__qualname__, _fingerprint(owner))
        if type(obj).__module__.startswith("kiln."):
            return None  # Kiln's data: graphs, nodes, guards, sources, attributes
        held = f" holding {obj.cell_contents!r:.80}" if isinstance(obj, types.CellType) else ""
        raise Uncacheable(f"a {type(obj).__qualname__} object{held}")


def _class_cell(owner: type) -> types.CellType | None:
    """The ``__class__`` cell of ``owner``'s methods (one per class body), if any."""
    for member in vars(owner).values():
        function = getattr(member, "__func__", member)
        code = getattr(function, "__code__", None)
        if code is not None and "__class__" in code.co_freevars:
            return function.__closure__[code.co_freevars.index("__class__")]
    return None


_PLAIN = (int, float, bool, str, bytes, complex, type(None), tuple, torch.dtype, torch.device)
_DATA_TYPES: dict[type, bool] = dict.fromkeys(_PLAIN, True)


def _is_data(cls: type) -> bool:
    """Whether every object of ``cls`` pickles by value unless an identity guard pins it: the
    plain types, and Kiln's own data classes (graphs, nodes, guards, sources, attributes),
    which :meth:`_Pickler.persistent_id` otherwise reaches after a dozen other checks."""
    known = _DATA_TYPES.get(cls)
    if known is None:
        special: tuple[type, ...] = (GraphRunner, ResumeTarget, Router, type, types.CodeType)
        special += (types.FunctionType, types.ModuleType, types.CellType, dict, torch.Tensor)
        special += _BY_REFERENCE
        known = cls.__module__.startswith("kiln.") and not issubclass(cls, special)
        _DATA_TYPES[cls] = known
    return known


def _class_cell_owner(obj: Any) -> type | None:
    """The class whose ``__class__`` cell ``obj`` is, when that class is found by its name
    (a guard read through a method's ``super()`` names the cell itself)."""
    if not isinstance(obj, types.CellType):
        return None
    with contextlib.suppress(Exception):
        owner = obj.cell_contents
        if not isinstance(owner, type):
            return None
        if _resolve(owner.__module__, owner.__qualname__) is owner and _class_cell(owner) is obj:
            return owner
    return None


def _kind(obj: Any) -> tuple[str, ...]:
    """What an object pinned by identity must be in a new process: its class (by name and
    fingerprint), and its own fingerprint when it is a function or class."""
    kind = type(obj)
    return (kind.__module__, kind.__qualname__, _fingerprint(kind), _fingerprint(obj))


def _module_of(scope: dict[str, Any]) -> types.ModuleType | None:
    """The module whose globals ``scope`` is, if any."""
    module = sys.modules.get(scope.get("__name__"))  # type: ignore[arg-type]
    return module if module is not None and vars(module) is scope else None


class _Unpickler(pickle.Unpickler):
    """Binds stored meanings to this process's objects (see the module docstring)."""

    def __init__(
        self,
        data: bytes,
        fn: types.FunctionType,
        values: tuple[Any, ...],
        compiler: Any,
        route: Router,
    ) -> None:
        super().__init__(io.BytesIO(data))
        self.fn, self.values, self.compiler, self.route = fn, values, compiler, route
        self.bound: dict[int, Source] = {}  # distinct objects at capture stay distinct

    def persistent_load(self, pid: Any) -> Any:
        kind, *rest = pid
        if kind == "globals":
            return self.fn.__globals__
        if kind == "module":
            return sys.modules.get(rest[0]) or importlib.import_module(rest[0])
        if kind == "module globals":
            return vars(importlib.import_module(rest[0]))
        if kind == "named":
            obj = _resolve(rest[0], rest[1])
            if _fingerprint(obj) != rest[2]:
                raise Mismatch(f"{rest[0]}.{rest[1]} changed since it was stored")
            return obj
        if kind == "at":
            return self._at(*rest)
        if kind == "graph":
            optimized, compiled = self.compiler(rest[0])
            return GraphRunner(optimized, compiled, rest[0])
        if kind == "resume":
            code = marshal.loads(rest[1])
            _CODE_KEYS[id(code)] = (code, rest[0])
            return ResumeTarget(code, self.route if rest[2] else None)
        if kind == "router":
            return self.route
        if kind == "class cell":
            owner = self.persistent_load(("named", *rest))
            cell = _class_cell(owner)
            if cell is None:
                raise Mismatch(f"{rest[0]}.{rest[1]} has no __class__ cell")
            return cell
        return marshal.loads(rest[0])

    def _at(self, source: Source, kind: tuple[str, ...]) -> Any:
        binder = Binder()
        expression = source.expr(binder)
        scope = dict(binder.names, ___f=self.fn)
        scope.update(zip(param_names(self.fn.__code__), self.values, strict=True))
        try:
            obj = eval(expression, scope)
        except Exception as error:
            raise Mismatch(f"{source} cannot be read ({type(error).__name__})") from error
        if _kind(obj) != kind:
            raise Mismatch(f"{source} is a {type(obj).__qualname__}, not the stored one")
        if self.bound.setdefault(id(obj), source) != source:
            raise Mismatch(f"{source} is {self.bound[id(obj)]}, two objects at capture")
        return obj


# --- the key and the files -----------------------------------------------------------------
_ENVIRONMENT: list[str] = []


def environment() -> str:
    """The Kiln source files (names, sizes, times), torch, Triton, Python and the device."""
    if not _ENVIRONMENT:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        parts = []
        for directory, _, names in sorted(os.walk(root)):
            for name in sorted(n for n in names if n.endswith(".py")):
                stat = os.stat(os.path.join(directory, name))
                parts.append(f"{directory[len(root) :]}/{name}:{stat.st_size}:{stat.st_mtime_ns}")
        with contextlib.suppress(Exception):
            parts.append(importlib.metadata.version("triton"))
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
        parts += [torch.__version__, sys.version, platform.machine(), device]
        _ENVIRONMENT.append(hashlib.sha256("\n".join(parts).encode()).hexdigest())
    return _ENVIRONMENT[0]


def key_of(code: types.CodeType, options: Any = None) -> str:
    """The file key of ``code`` compiled with ``options`` (a resume function's key: its
    code's as stored, since a code object made from a stored one may digest differently)."""
    known = _CODE_KEYS.get(id(code))
    if known is not None and known[0] is code:
        return known[1]
    return hashlib.sha256(f"{code_digest(code)}{options!r}".encode()).hexdigest()[:40]


def _path(code: types.CodeType, options: Any) -> Path:
    digest = hashlib.sha256(f"{key_of(code)}{options!r}{environment()}".encode())
    return Path(config.cache_dir) / "artifacts" / f"{digest.hexdigest()[:40]}.kart"


def read_entries(path: Path) -> list[tuple[bytes, bytes]]:
    """The entries stored at ``path``; a damaged file is removed with a warning."""
    payload = read_checked(path, MAGIC)
    return [] if payload is None else pickle.loads(payload)


def write_entries(path: Path, entries: list[tuple[bytes, bytes]]) -> None:
    write_checked(path, MAGIC, pickle.dumps(entries, protocol=pickle.HIGHEST_PROTOCOL))
    evict(config.artifact_cache_bytes)


def evict(bound: int) -> list[Path]:
    """Remove the least recently used files until the artifacts take ``bound`` bytes."""
    files = []
    for path in (Path(config.cache_dir) / "artifacts").glob("*.kart"):
        with contextlib.suppress(OSError):
            stat = path.stat()
            files.append((stat.st_mtime_ns, stat.st_size, path))
    total = sum(size for _, size, _ in files)
    removed = []
    for _, size, path in sorted(files, key=lambda item: item[0]):
        if total <= bound:
            break
        with contextlib.suppress(OSError):
            path.unlink()
            removed.append(path)
        total -= size
    return removed


# --- storing and reusing entries -------------------------------------------------------------
def _pinned(guards: list[Guard]) -> dict[int, Source]:
    """Where each object an identity guard pins was read (and each closure cell of a pinned
    function: ``f.__closure__[i]``)."""
    pinned: dict[int, Source] = {}
    for guard in guards:
        obj, source = getattr(guard, "obj", None), guard.source
        pins = isinstance(guard, Identity) and obj is not None and source is not None
        if pins and not isinstance(obj, types.ModuleType):
            pinned.setdefault(id(obj), source)  # type: ignore[arg-type]
            _pin_cells(pinned, obj, source)  # type: ignore[arg-type]
    return pinned


def _pin_cells(pinned: dict[int, Source], obj: Any, source: Source) -> None:
    """The closure cells of ``obj`` (a function) or of its class's functions (a decorated
    ``forward``), by path: ``f.__closure__[i]``, ``x.__class__.__mro__[k].__dict__['f']...``"""
    functions = [(obj, source)] if isinstance(obj, types.FunctionType) else []
    if not isinstance(obj, (type, types.FunctionType)):
        mro = Attr(Attr(source, "__class__"), "__mro__")
        for k, cls in enumerate(type(obj).__mro__):
            for name, member in vars(cls).items():
                if isinstance(member, types.FunctionType) and member.__closure__:
                    functions.append((member, Item(Attr(Item(mro, k), "__dict__"), name)))
    for function, path in functions:
        for i, cell in enumerate(function.__closure__ or ()):
            pinned.setdefault(id(cell), Item(Attr(path, "__closure__"), i))


def _dumps(obj: Any, fn: types.FunctionType, at: dict[int, Source]) -> bytes:
    buffer = io.BytesIO()
    _Pickler(buffer, fn, at).dump(obj)
    return buffer.getvalue()


def _unstorable(capture: Capture, fn: types.FunctionType, at: dict[int, Source]) -> list[str]:
    """The parts of ``capture`` that do not pickle (head names, guards, fields), for the log."""
    parts = [(f"head name {k}", v) for k, v in capture.scope.items()]
    parts += [(f"guard {g}", g) for g in capture.guards]
    parts += [(f"field {f.name}", getattr(capture, f.name)) for f in dataclasses.fields(capture)]
    found = []
    for name, obj in parts:
        with contextlib.suppress(Exception):
            _dumps(obj, fn, at)
            continue
        found.append(name[:200])
    return found[:4]


def store(fn: types.FunctionType, capture: Capture, options: Any) -> None:
    """Add ``capture`` to the file of ``fn``'s code (or log why it cannot be stored)."""
    if not config.artifact_cache:
        return
    at = _pinned([*capture.guards, *capture.plan_guards])
    held = [v for v in capture.scope.values() if type(v) in (list, dict, set)]
    held = [v for v in held if v is not fn.__globals__]
    if any(id(v) not in at and not (type(v) is dict and _module_of(v)) for v in held):
        _log.info("not storing %s: its head holds a container by identity", fn.__qualname__)
        return
    # (the shape environment only explains: its symbols are in the graph and the size guard)
    rest = dataclasses.replace(
        capture, head=None, graph=None, guards=[], shapes=None, plan_guards=[]
    )
    try:
        guards = (capture.guards, capture.plan_guards)
        entry = (_dumps(guards, fn, at), _dumps(rest, fn, at))
    except Exception as error:  # (storing is an optimization: the program runs on)
        where = _unstorable(capture, fn, at)
        _log.info("not storing %s: %s (in %s)", fn.__qualname__, error, where)
        return
    path = _path(fn.__code__, options)
    entries = read_entries(path)
    if entry not in entries:
        try:
            write_entries(path, [entry, *entries][:MAX_ENTRIES])
        except OSError as error:  # (a read-only cache directory: the program runs on)
            _log.info("not storing %s: %s", fn.__qualname__, error)
            return
        _log.info("stored an entry of %s in %s", fn.__qualname__, path)


def reuse(
    fn: types.FunctionType,
    values: tuple[Any, ...],
    compiler: Any,
    route: Router,
) -> tuple[Capture, tuple[Any, str, Any]] | None:
    """A stored capture of ``fn``'s code whose objects bind and whose guards pass on
    ``values`` (its graphs compiled again), with its compiled guards, or None (tried on every
    miss: an entry stored for one instance binds to another of the same class)."""
    if not config.artifact_cache:
        return None
    for guards_data, rest_data in read_entries(_path(fn.__code__, compiler.options)):
        try:
            guards, plan = _Unpickler(guards_data, fn, values, compiler, route).load()
            names = param_names(fn.__code__)
            if plan and not compile_guards([*guards, *plan], names)[0](fn, *values):
                continue  # (its head breaks at a call because of another callee)
            compiled = compile_guards(guards, names)
            if not compiled[0](fn, *values):
                continue
            capture: Capture = _Unpickler(rest_data, fn, values, compiler, route).load()
        except Exception as error:  # a stored entry is never worth a failure: capture instead
            _log.info(
                "stored entry of %s not used: %s: %s", fn.__qualname__, type(error).__name__, error
            )
            continue
        scope = dict(capture.scope)
        exec(compiled_code(capture.head_source, f"<kiln head of {fn.__qualname__}>"), scope)
        runners = [v for v in capture.scope.values() if isinstance(v, GraphRunner)]
        graph = runners[0].graph if runners else None
        reused = dataclasses.replace(capture, head=scope["___head"], guards=guards, graph=graph)
        return reused, compiled
    return None
