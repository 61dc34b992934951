"""Checks of Kiln's bytecode layer that run on any supported CPython, torch or not.

``python3.12 tests/capture/bytecode_versions.py`` runs every ``check_*`` function below and
exits non-zero on a failure; ``test_bytecode.py`` runs the same checks under pytest on the CI
interpreter and spawns this script on the other interpreters it finds.

The modules under test are loaded from their files (``kiln/__init__`` imports torch, which
3.12/3.13 here lack), so this file imports nothing from kiln at module level either.
"""

from __future__ import annotations

import contextlib
import dis
import importlib
import importlib.util
import inspect
import sys
import time
import traceback
import types
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
PY = sys.version_info[:2]


def load_capture_modules() -> tuple[Any, Any, Any]:
    """kiln.capture.bytecode.{decode, assembler, rewrite}: imported normally where kiln can be
    (the CI interpreter, with torch), else from their files under stand-in ``kiln`` and
    ``kiln.capture`` packages, whose real ``__init__`` modules need torch."""
    if importlib.util.find_spec("torch") is None or importlib.util.find_spec("kiln") is None:
        for name, folder in (("kiln", "kiln"), ("kiln.capture", "kiln/capture")):
            package = types.ModuleType(name)
            package.__path__ = [str(ROOT / folder)]
            sys.modules[name] = package
    names = ("decode", "assembler", "rewrite")
    return tuple(importlib.import_module(f"kiln.capture.bytecode.{n}") for n in names)  # type: ignore[return-value]


bytecode, assembler, rewrite = load_capture_modules()
StackSlot = rewrite.StackSlot


def code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from code_objects(const)


def module_code(name: str) -> types.CodeType:
    path = inspect.getsourcefile(importlib.import_module(name))
    assert path is not None
    return compile(Path(path).read_text(encoding="utf-8"), path, "exec")


# ---------------------------------------------------------------------------------------------
# Hand-written functions covering the constructs whose bytecode differs between versions.

HANDWRITTEN = """
import contextlib

def try_except_finally(x):
    try:
        y = 1 / x
    except ZeroDivisionError as e:
        y = str(e)
    except (TypeError, ValueError):
        raise
    else:
        y = y * 2
    finally:
        x = None
    return y

def nested_with(a, b):
    with contextlib.nullcontext(a) as p, contextlib.nullcontext(b) as q:
        with contextlib.suppress(KeyError):
            return {}[p + q]
    return a

def nested_loops(n):
    out = []
    for i in range(n):
        j = 0
        while j < i:
            if (i + j) % 3 == 0:
                break
            j += 1
        else:
            continue
        out.append((i, j))
    return out

def generator(n):
    try:
        for i in range(n):
            got = yield i
            if got:
                yield from range(got)
    finally:
        pass

async def coroutine(xs):
    async with contextlib.AsyncExitStack() as stack:
        async for x in xs:
            await stack.enter_async_context(contextlib.nullcontext(x))
    return [y async for y in xs]

def comprehensions(xs):
    a = [x * x for x in xs if x]
    b = {x: [y for y in range(x)] for x in xs}
    c = {x % 3 for x in xs}
    d = sum(x for x in xs)
    return a, b, c, d

def fstrings(a, b):
    return f"{a!r:>{b}} {b:x} {a=} {'q'}{a}"

class Base:
    def m(self, x):
        return x + 1

class Child(Base):
    def m(self, x):
        return super().m(x) * 2

    def explicit(self, x):
        return super(Child, self).m(x)

def closures(a):
    b = a + 1
    def inner(c):
        nonlocal b
        b += c
        return lambda: a + b + c
    return inner(2)()

def matching(v):
    match v:
        case [1, *rest]:
            return rest
        case {"k": x, **others}:
            return x, others
        case Base(m=m) if m:
            return "base"
        case str() | bytes():
            return "text"
        case _:
            return None

def exception_groups(x):
    try:
        raise ExceptionGroup("g", [ValueError(x), TypeError(x)])
    except* ValueError as e:
        x = len(e.exceptions)
    except* TypeError:
        pass
    return x

def keyword_calls(f, *a, **k):
    return f(1, *a, key=2, **k), f(x=1), print(*a, sep="")
"""


def big_function_source(n: int = 300) -> str:
    """More than 256 locals, constants and names, and jumps longer than 255 code units, so
    arguments and jump offsets need EXTENDED_ARG."""
    lines = [f"g{i} = None" for i in range(40)] + ["def big(n):", "    total = 0"]
    lines += [f"    v{i} = n + {1000 + 7 * i}" for i in range(n)]
    lines += ["    for k in range(3):"]
    lines += [f"        if v{i} % 3 == k and g{i % 40} is None: total += v{i}" for i in range(n)]
    lines += ["    return total"]
    return "\n".join(lines)


def handwritten_namespace() -> dict[str, Any]:
    namespace: dict[str, Any] = {"__name__": "handwritten"}
    exec(compile(HANDWRITTEN, "<handwritten>", "exec"), namespace)
    exec(compile(big_function_source(), "<big>", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------------------------------------
# Decode and assemble

ROUNDTRIP_MODULES = ["ast", "json", "json.decoder", "json.encoder", "argparse", "inspect"]
ROUNDTRIP_MODULES += ["dataclasses", "functools", "enum", "typing", "asyncio.tasks", "difflib"]


def assert_roundtrip(code: types.CodeType) -> bool:
    """Re-assemble ``code`` from its decoded form; True if even the line table bytes agree."""
    new = assembler.assemble(bytecode.decode(code), code)
    where = f"{code.co_name} ({code.co_filename}:{code.co_firstlineno})"
    assert new.co_code == code.co_code, f"co_code differs for {where}"
    assert new.co_exceptiontable == code.co_exceptiontable, f"exception table differs: {where}"
    assert new.co_stacksize == code.co_stacksize, f"co_stacksize differs for {where}"
    assert list(new.co_positions()) == list(code.co_positions()), f"positions differ: {where}"
    return new.co_linetable == code.co_linetable


def check_roundtrip_stdlib() -> str:
    codes = [c for m in ROUNDTRIP_MODULES for c in code_objects(module_code(m))]
    same_linetable = sum(assert_roundtrip(code) for code in codes)
    assert len(codes) > 1000
    return f"{len(codes)} code objects, {same_linetable} with identical line-table bytes"


def check_roundtrip_handwritten() -> str:
    sources = [(HANDWRITTEN, "<handwritten>"), (big_function_source(), "<big>")]
    codes = [c for src, name in sources for c in code_objects(compile(src, name, "exec"))]
    for code in codes:
        assert_roundtrip(code)
    big = next(c for c in codes if c.co_name == "big")
    assert dis.opmap["EXTENDED_ARG"] in big.co_code[::2], "big() should need EXTENDED_ARG"
    return f"{len(codes)} code objects"


def check_decode_virtualizes_jumps_and_handlers() -> str:
    checked = 0
    for module in ("argparse", "asyncio.tasks"):
        for code in code_objects(module_code(module)):
            dis_jumps = {
                i.offset: i.argval
                for i in dis.get_instructions(code)
                if i.opcode in dis.hasjrel + dis.hasjabs
            }
            for inst in bytecode.decode(code):
                assert inst.opname not in ("CACHE", "EXTENDED_ARG")
                if inst.opname in bytecode.JUMP_OPNAMES:
                    target = dis_jumps[inst.offset]
                    assert (
                        inst.target.offset - 2 * bytecode.extended_arg_count(inst.target.arg)
                        <= target
                        <= inst.target.offset
                    ), (code.co_name, inst)
                    checked += 1
            parse = getattr(dis, "_parse_exception_table", None)
            if parse is not None:
                theirs = [tuple(e)[:5] for e in parse(code)]
                assert [tuple(e) for e in bytecode.exception_table(code)] == theirs
    assert bytecode.inline_cache_entries("LOAD_GLOBAL") == {11: 5}.get(PY[1], 4)
    assert bytecode.inline_cache_entries("NOP") == 0
    return f"{checked} jumps"


def outcome(fn: Callable[..., Any], args: tuple[Any, ...]) -> tuple[Any, ...]:
    try:
        return ("returned", fn(*args))
    except Exception as error:
        return ("raised", type(error), str(error))


EDIT_ARGS: dict[str, list[tuple[Any, ...]]] = {
    "try_except_finally": [(0,), (2,), ("x",)],
    "nested_loops": [(7,)],
    "comprehensions": [([0, 1, 2, 5],)],
    "matching": [([1, 2, 3],), ({"k": 1, "z": 2},), ("s",), (3.5,)],
    "big": [(5,)],
}


def check_assemble_after_edits() -> str:
    """Insert a NOP before every instruction (jumps retarget, offsets and EXTENDED_ARGs grow,
    handlers and positions follow) and check the functions still compute the same.  A 3.12+
    FOR_ITER must keep its END_FOR target: it resumes *after* it once the loop is done."""
    namespace = handwritten_namespace()
    edited = 0
    for name in EDIT_ARGS:
        fn = namespace[name]
        insts: list[Any] = []
        for inst in bytecode.decode(fn.__code__):
            if not insts or insts[-1].opname != "END_FOR":  # 3.13 skips END_FOR + POP_TOP
                insts.append(bytecode.Instruction("NOP", handler=inst.handler))
            insts.append(inst)
        for inst in insts:  # jumps to an instruction now land on its NOP ...
            if inst.target is not None and inst.opname != "FOR_ITER":  # ... except loop exits
                before = insts[insts.index(inst.target) - 1]
                inst.target = before if before.opname == "NOP" else inst.target
        code = assembler.assemble(insts, fn.__code__)
        clone = types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)
        for args in EDIT_ARGS[name]:
            assert outcome(clone, args) == outcome(fn, args), name
        edited += 1
    return f"{edited} functions"


GENERIC_JUMPS = {"JUMP_FORWARD": "JUMP", "JUMP_BACKWARD": "JUMP"}
GENERIC_JUMPS["JUMP_BACKWARD_NO_INTERRUPT"] = "JUMP_NO_INTERRUPT"


def check_generic_jump_names() -> str:
    """Version-neutral jump names (JUMP, POP_JUMP_IF_FALSE ...) assemble to each version's
    direction variants: the same bytes as CPython's."""
    namespace = handwritten_namespace()
    renamed = 0
    for name in ("nested_loops", "try_except_finally", "generator", "big"):
        code = namespace[name].__code__
        insts = bytecode.decode(code)
        for inst in insts:
            generic = inst.opname.replace("_FORWARD_IF", "_IF").replace("_BACKWARD_IF", "_IF")
            generic = GENERIC_JUMPS.get(generic, generic)
            renamed += generic != inst.opname
            inst.opname = generic
        assert assembler.assemble(insts, code).co_code == code.co_code, name
    assert renamed >= 5
    return f"{renamed} jumps renamed"


def check_assembler_rejects_invalid_lists() -> str:
    def loop(xs: list[int]) -> int:
        total = 0
        for x in xs:
            if x:
                total += x
        return total

    template = loop.__code__
    stray = bytecode.Instruction("NOP")
    broken: list[list[Any]] = [
        [bytecode.Instruction("JUMP_FORWARD", target=stray)],  # target not in the list
        [bytecode.Instruction("LOAD_CONST")],  # no arg
        [bytecode.Instruction("LOAD_CONST", 0), bytecode.Instruction("POP_TOP")],  # falls off
    ]
    insts = bytecode.decode(template)
    for_iter = next(i for i in insts if i.opname == "FOR_ITER")
    if PY >= (3, 12):  # an exhausted FOR_ITER skips its target: it must be the END_FOR
        moved = list(insts)
        moved.insert(moved.index(for_iter.target), bytecode.Instruction("NOP"))
        for_iter.target = moved[moved.index(for_iter.target) - 1]
        broken.append(moved)
        backward = bytecode.decode(template)
        jump = next(i for i in backward if "POP_JUMP" in i.opname)
        jump.target = backward[1]  # 3.12+ conditional jumps only go forward
        broken.append(backward)
    for candidate in broken:
        try:
            assembler.assemble(candidate, template)
        except assembler.AssemblyError:
            continue
        raise AssertionError(f"assembled {candidate}")
    return f"{len(broken)} rejected"


def check_bytecode_package_oracle() -> str:
    """If the `bytecode` package is installed, its assembler recomputes the same stack size and
    exception table for code that CPython never compiled (routed copies).  Not for resume
    functions: it reaches handlers only through their (here unreachable) try-begin marker and
    under-counts their depth (4 instead of 6 for ``in_with``'s resume function)."""
    try:
        import bytecode as oracle  # type: ignore[import-not-found]
    except ImportError:
        return "skipped (bytecode package not installed)"
    codes = [
        rewrite.route_calls(code, "router", nested=False)
        for module in ("argparse", "json.decoder")
        for code in code_objects(module_code(module))
    ]
    for code in codes:
        theirs = oracle.Bytecode.from_code(code).to_code()
        assert theirs.co_stacksize == code.co_stacksize, code.co_name
        assert theirs.co_exceptiontable == code.co_exceptiontable, code.co_name
    return f"{len(codes)} code objects agree with bytecode {oracle.__version__}"


# ---------------------------------------------------------------------------------------------
# Resume functions


class _Stop(BaseException):
    """Raised by the tracer to end the original run where the resumed one takes over."""


def traced_locals(fn: Callable[..., Any], args: tuple[Any, ...], stop: int | None) -> Any:
    """Run ``fn`` under an opcode tracer.  With ``stop=None``: the offsets it executes; else
    the locals just before the instruction at ``stop``, the run ending there -- so mutable state
    (a closure's cells, a list) is seen as it was, not as the rest of the run left it."""
    seen: dict[int, dict[str, Any]] = {}

    def tracer(frame: types.FrameType, event: str, arg: Any) -> Any:
        if frame.f_code is not fn.__code__:
            return None
        frame.f_trace_opcodes = True

        def opcode(frame: types.FrameType, event: str, arg: Any) -> Any:
            if event == "opcode":
                seen.setdefault(frame.f_lasti, {})
                if frame.f_lasti == stop:
                    seen[stop] = dict(frame.f_locals)
                    raise _Stop
            return opcode

        return opcode

    for _ in range(2):  # 3.12.1 ignores f_trace_opcodes set during the first traced call
        sys.settrace(tracer)
        try:
            fn(*args)
        except _Stop:
            return seen[stop]  # type: ignore[index]
        finally:
            sys.settrace(None)
    assert stop is None, f"{fn.__name__} never reached offset {stop}"
    return set(seen)


def resume_function(
    fn: Callable[..., Any], offset: int, stack: list[Any], live: list[str]
) -> Callable[..., Any]:
    name = f"<kiln resume in {fn.__name__} at {offset}>"
    code = rewrite.resume_code(fn.__code__, offset, stack, live, name=name)
    assert code.co_name == code.co_qualname == name
    return types.FunctionType(code, fn.__globals__, name, None, fn.__closure__)


def resume_everywhere(fn: Callable[..., Any], args: tuple[Any, ...], every: int = 1) -> int:
    """Resume ``fn`` at every statement boundary (empty stack) it reached, with the live locals
    a real run had there; each resumed run must return what the whole run returned."""
    expected = fn(*args)
    reached = traced_locals(fn, args, None)
    insts = bytecode.decode(fn.__code__)
    depths = assembler.stack_depths(insts)
    points = [
        inst.offset
        for inst, depth in zip(insts, depths, strict=True)
        if depth == 0 and inst.offset in reached and inst.opname not in PROLOGUE
    ]
    for offset in points[::every]:
        seen = traced_locals(fn, args, offset)
        live = sorted(n for n in rewrite.live_locals(fn.__code__, offset) if n in seen)
        got = resume_function(fn, offset, [], live)(*[seen[n] for n in live])
        assert got == expected, (fn.__name__, offset, got, expected)
    assert points, fn.__name__
    return len(points[::every])


PROLOGUE = ("RESUME", "MAKE_CELL", "COPY_FREE_VARS")


def marker() -> None:
    """A call that resume tests break after."""


def offset_after(fn: Callable[..., Any], callee: str) -> int:
    """Offset of the instruction after the call of the global ``callee`` (its POP_TOP)."""
    insts = bytecode.decode(fn.__code__)
    start = next(i for i, inst in enumerate(insts) if inst.argval == callee)
    call = next(i for i in range(start, len(insts)) if insts[i].opname == "CALL")
    return insts[call + 1].offset


def cells_and_comprehensions(a: int, b: int) -> Any:
    x = a + b
    y = [x * i for i in range(3)]
    z = {k: v for k, v in zip("abc", y, strict=True)}
    w = x - 1 if x > 3 else x + 1
    i = 7
    g = lambda: w + x + a
    s = f"{a}-{b!r}-{w:>4}"
    q = [i for i in range(w)]  # 3.12+ saves and restores the outer i around the loop
    return x, y, z, g(), s, q, i


def make_closure(k: int) -> Callable[[int], Any]:
    c = k * 10

    def inner(a: int) -> Any:
        t = a + c
        u = [t + j for j in range(2)]
        return t, u, c

    return inner


def many_locals(n: int) -> int:
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = a8 = a9 = n
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = b8 = b9 = n + 1
    total = a0 + a1 + a2 + a3 + a4 + a5 + a6 + a7 + a8 + a9
    total += b0 + b1 + b2 + b3 + b4 + b5 + b6 + b7 + b8 + b9
    return total + a0 * b9 + a9 * b0


class Counter3:
    def total(self, x: int) -> int:
        return x * 3


class Counter5(Counter3):
    def total(self, x: int) -> int:
        first = super().total(x)  # 3.12+ LOAD_SUPER_ATTR: its generic path calls super() bare
        marker()
        bare = super()  # a plain zero-argument call reads the frame's first local slot
        again = bare.total(first) + super().total(1) + super(Counter5, self).total(3)  # noqa: UP008
        return again + f(self) if (f := lambda s: super(Counter5, s).total(2)) else 0  # noqa: UP008


def check_resume_at_statement_boundaries() -> str:
    namespace = handwritten_namespace()
    cases: list[tuple[Callable[..., Any], tuple[Any, ...], int]] = [
        (cells_and_comprehensions, (1, 2), 1),
        (cells_and_comprehensions, (5, 2), 1),
        (make_closure(3), (4,), 1),
        (many_locals, (3,), 1),
        (Counter5.total, (Counter5(), 2), 1),
        (namespace["nested_loops"], (6,), 1),
        (namespace["closures"], (2,), 1),
        (namespace["fstrings"], ("a", 6), 1),
        (namespace["matching"], ({"k": 1, "z": 2},), 1),
        (namespace["big"], (4,), 29),
    ]
    return f"{sum(resume_everywhere(fn, args, every) for fn, args, every in cases)} offsets"


class Recorder:
    def __init__(self, log: list[Any], swallow: bool = False) -> None:
        self.log, self.swallow = log, swallow

    def __enter__(self) -> Recorder:
        self.log.append("enter")
        return self

    def __exit__(self, kind: Any, value: Any, tb: Any) -> bool:
        self.log.append(("exit", kind and kind.__name__))
        return self.swallow


def in_with(cm: Any, a: int, fail: bool) -> int:
    with cm:
        b = a * 2
        marker()
        if fail:
            raise KeyError(b)
        c = b + 1
    return c


def check_resume_inside_with() -> str:
    offset = offset_after(in_with, "marker")
    assert rewrite.stack_depth_at(in_with.__code__, offset) == 2  # __exit__, marker()'s None
    assert rewrite.live_locals(in_with.__code__, offset) >= {"b", "fail"}
    stack = [StackSlot.CONTEXT, StackSlot.VALUE]
    log: list[Any] = []
    resume = resume_function(in_with, offset, stack, ["b", "fail"])
    assert resume(Recorder(log), None, 8, False) == 9
    assert log == ["enter", ("exit", None)]
    log.clear()
    try:
        resume(Recorder(log), None, 4, True)
        raise AssertionError("KeyError expected")
    except KeyError as error:
        tb = error.__traceback__
        assert tb is not None
        while tb.tb_next is not None:
            tb = tb.tb_next
        assert tb.tb_lineno == in_with.__code__.co_firstlineno + 5  # the user's `raise` line
    assert log == ["enter", ("exit", "KeyError")]
    with contextlib.suppress(UnboundLocalError):  # a swallowed error leaves `c` unbound ...
        resume(Recorder(log, swallow=True), None, 4, True)
        raise AssertionError("UnboundLocalError expected")  # ... exactly as in the original
    offset = offset_after(in_two_withs, "marker")
    log.clear()
    stack = [StackSlot.CONTEXT, StackSlot.CONTEXT, StackSlot.VALUE]
    resume = resume_function(in_two_withs, offset, stack, ["a"])
    assert resume(Recorder(log), Recorder(log), None, 3) == 4
    assert log == ["enter", "enter", ("exit", None), ("exit", None)]
    return "ok"


def in_two_withs(a: int) -> int:
    with contextlib.nullcontext(), contextlib.nullcontext():
        marker()
        a += 1
    return a


def in_loop(xs: list[int]) -> int:
    acc = 0
    for x in xs:
        acc += x
        marker()
    return acc


def in_try(a: int) -> Any:
    try:
        b = a + 1
        marker()
        return 1 / b
    except ZeroDivisionError:
        return "zero"


def keyword_call(g: Callable[..., int], y: int) -> int:
    z = g(y, k=2)
    return z * 2


def check_resume_with_stack_values() -> str:
    offset = offset_after(in_loop, "marker")
    iterator = iter([1, 2, 3, 4])
    next(iterator)
    assert rewrite.live_locals(in_loop.__code__, offset) == {"acc"}
    resume = resume_function(in_loop, offset, [StackSlot.VALUE, StackSlot.VALUE], ["acc"])
    assert resume(iterator, None, 1) == 10

    offset = offset_after(in_try, "marker")
    resume = resume_function(in_try, offset, [StackSlot.VALUE], ["b"])
    assert (resume(None, 0), resume(None, 2)) == ("zero", 0.5)

    # At the start of a call sequence: NULL and callee order is the version's.
    insts = bytecode.decode(keyword_call.__code__)
    at = next(i for i, x in enumerate(insts) if x.argval == ("k",) or x.opname == "KW_NAMES")
    stack = [StackSlot.NULL, StackSlot.VALUE] if PY < (3, 13) else [StackSlot.VALUE, StackSlot.NULL]
    stack += [StackSlot.VALUE, StackSlot.VALUE]
    resume = resume_function(keyword_call, insts[at].offset, stack, [])
    assert resume(lambda y, k: y + k, 5, 2) == 14
    return "ok"


def check_resume_rejects_bad_requests() -> str:
    def gen() -> Iterator[int]:
        yield 1

    insts = bytecode.decode(keyword_call.__code__)
    call = next(i for i, x in enumerate(insts) if x.opname in ("CALL", "CALL_KW"))
    bad: list[tuple[Callable[..., Any], int, list[Any], list[str]]] = [
        (gen, 2, [], []),  # generators are not resumable this way
        (in_loop, offset_after(in_loop, "marker"), [], ["acc"]),  # wrong stack depth
        (in_loop, 0, [], []),  # inside the prologue
        (in_loop, offset_after(in_loop, "marker"), [StackSlot.VALUE] * 2, ["nope"]),
    ]
    if PY < (3, 13):  # between KW_NAMES/PRECALL and CALL the call is half-prepared
        bad.append((keyword_call, insts[call].offset, [StackSlot.VALUE] * 4, []))
    for fn, offset, stack, live in bad:
        try:
            rewrite.resume_code(fn.__code__, offset, stack, live, name="x")
        except ValueError:
            continue
        raise AssertionError(f"resume_code accepted {fn.__name__} at {offset}")
    return f"{len(bad)} rejected"


# ---------------------------------------------------------------------------------------------
# Call routing

ROUTED: list[Any] = []


def __kiln_router__(callee: Any) -> Any:
    ROUTED.append(callee)
    return callee


def wrapping_router(callee: Any) -> Any:
    """A router that, like Kiln's, hands back a different callable for Python functions."""
    ROUTED.append(callee)
    if isinstance(callee, types.FunctionType):
        return lambda *args, **kwargs: callee(*args, **kwargs)
    return callee


def add(a: int, b: int = 2, *, c: int = 3) -> int:
    return a + b + c


class Shape:
    def area(self, scale: int) -> int:
        return 10 * scale

    @classmethod
    def unit(cls) -> Shape:
        return cls()

    @staticmethod
    def twice(x: int) -> int:
        return 2 * x


class Square(Shape):
    def area(self, scale: int) -> int:
        return super().area(scale) + 1

    def explicit(self) -> int:
        return super(Square, self).area(2)  # noqa: UP008

    def bare(self) -> int:
        parent = super()
        return parent.area(3)


def calls(xs: list[int], k: int) -> Any:
    total = add(1) + add(1, b=5, c=k) + add(*xs, **{"c": 1})
    sq = Square.unit()
    total += sq.area(3) + sq.explicit() + sq.bare() + Shape.twice(k)
    total += len([add(x) for x in xs]) + sum(add(x) for x in xs)
    total += (add if k else len)(1)
    total += add(add(k))
    text = "abc".upper().lower()
    with contextlib.nullcontext(k) as ctx:
        total += abs(ctx)
    try:
        int("x")
    except ValueError as error:
        text += type(error).__name__
    return total, text, str(k).join(["a", "b"]), (lambda v: add(v))(4)


EXPECTED_CALLEES = Counter(
    ["add"] * 11 + ["unit", "area", "explicit", "bare", "twice", "upper", "lower", "abs"]
    + ["len", "sum", "str", "join", "int", "type", "nullcontext", "Square.area"]
)  # fmt: skip


def routed_copy(fn: Callable[..., Any], router: str = "__kiln_router__") -> Any:
    code = rewrite.route_calls(fn.__code__, router)
    return types.FunctionType(code, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def callee_name(callee: Any) -> str:
    name = getattr(callee, "__qualname__", getattr(callee, "__name__", type(callee).__name__))
    return "Square.area" if name == "Shape.area" else name.split(".")[-1]


def check_route_calls() -> str:
    originals = {f: f.__code__ for f in (Square.area, Square.explicit, Square.bare)}
    try:
        for method in originals:  # methods with zero-argument super() route too
            method.__code__ = routed_copy(method).__code__
        for router in ("__kiln_router__", "wrapping_router"):
            ROUTED.clear()
            assert routed_copy(calls, router)([1, 2], 4) == calls([1, 2], 4)
            seen = Counter(callee_name(c) for c in ROUTED)
            missing = EXPECTED_CALLEES - seen
            assert not missing, f"not routed: {missing}"
    finally:
        for method, code in originals.items():
            method.__code__ = code
    plan = rewrite.plan_call_routing(calls.__code__)
    assert not plan.unrouted, plan
    assert len(plan.exempt) == 1  # the with block's __exit__ call
    assert len(rewrite.plan_call_routing(Square.bare.__code__).exempt) == 1  # super()
    return f"{len(plan.routed)} call sites"


ROUTED_MODULE_WORKLOADS: dict[str, Callable[[Any], Any]] = {
    "textwrap": lambda m: (m.fill("The quick brown fox jumps " * 9, width=23), m.dedent(" a\n b")),
    "difflib": lambda m: list(m.unified_diff(["a", "b", "c", "d"], ["a", "c", "d", "e"])),
    "fractions": lambda m: str(m.Fraction(3, 4) + m.Fraction("1/3")),
    "statistics": lambda m: (m.mean([1, 2, 3, 4]), m.median([3, 1, 2]), m.stdev([1.0, 2.0, 4.0])),
    "ast": lambda m: m.unparse(m.parse("def f(a, *b, c=1):\n    return [x for x in a] or {c: b}")),
    "json.encoder": lambda m: m.JSONEncoder(indent=2, sort_keys=True).encode({"a": [1, None]}),
    "shlex": lambda m: (m.split("a 'b c' d\\ e"), m.quote("it's")),
    "argparse": lambda m: vars(argparse_demo(m)),
    "ipaddress": lambda m: [str(h) for h in m.ip_network("192.168.0.0/29").hosts()],
    "pprint": lambda m: m.pformat({f"k{i}": list(range(i)) for i in range(8)}, width=40),
    "tokenize": lambda m: [t.string for t in m.generate_tokens(iter(["x = f(1)\n"]).__next__)],
    "enum": lambda m: [e.name for e in m.Flag("E", ["A", "B", "C"])],
}


def argparse_demo(m: Any) -> Any:
    parser = m.ArgumentParser(prog="demo")
    parser.add_argument("--x", type=int, default=3)
    parser.add_argument("ys", nargs="*")
    return parser.parse_args(["--x", "5", "a", "b"])


def routed_module(name: str) -> types.ModuleType:
    """A fresh copy of a stdlib module whose code (functions, methods, nested code) is routed."""
    original = importlib.import_module(name)
    module = types.ModuleType(f"routed_{name}")
    module.__dict__.update(
        __kiln_router__=__kiln_router__,
        __package__=original.__package__,
        __file__=original.__file__,
    )
    sys.modules[module.__name__] = module  # some modules look themselves up while importing
    exec(rewrite.route_calls(module_code(name), "__kiln_router__"), module.__dict__)
    return module


def check_route_calls_on_stdlib_modules() -> str:
    """Whole stdlib modules run identically with every call routed; almost no call is left."""
    for name, workload in ROUTED_MODULE_WORKLOADS.items():
        ROUTED.clear()
        expected = workload(importlib.import_module(name))
        assert repr(workload(routed_module(name))) == repr(expected), name
        assert ROUTED, name
    totals: Counter[str] = Counter()
    for code in (c for m in ROUNDTRIP_MODULES for c in code_objects(module_code(m))):
        plan = rewrite.plan_call_routing(code)
        totals.update(routed=len(plan.routed), exempt=len(plan.exempt))
        totals.update(unrouted=len(plan.unrouted))
    assert totals["unrouted"] * 100 < totals["routed"], totals
    return ", ".join(f"{k} {v}" for k, v in sorted(totals.items()))


CHECKS: list[Callable[[], str]] = [
    value for key, value in sorted(globals().items()) if key.startswith("check_")
]


def main() -> int:
    failed = 0
    for check in CHECKS:
        start = time.perf_counter()
        try:
            outcome = check()
        except Exception:
            failed += 1
            outcome = "FAILED\n" + traceback.format_exc()
        print(f"{PY[0]}.{PY[1]} {check.__name__}: {outcome} ({time.perf_counter() - start:.1f}s)")
    print(f"{PY[0]}.{PY[1]}: {len(CHECKS) - failed}/{len(CHECKS)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
