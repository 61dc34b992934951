"""Kernel -> Triton source: one ``@triton.jit`` function per loop-level :class:`Kernel`.

Three forms, chosen by :func:`choose_blocks`:

- **pointwise** (no reduction): a 1-D grid over ``x``; ``xindex`` is ``[XBLOCK]``.
- **persistent reduction**: ``XBLOCK`` rows per program, each row whole in registers
  (``RBLOCK = next_pow2(rnumel)``); every reduction phase reads the same registers, so a
  softmax loads its row once and computes one ``exp`` per element.
- **looped reduction**: one ``for`` loop per reduction phase accumulates ``[XBLOCK, RBLOCK]``
  lanes, reduced across lanes after the loop; row-shaped values are recomputed in each loop,
  and a last loop does the row-shaped stores.

In reduction kernels ``xindex`` is ``[XBLOCK, 1]`` and ``rindex`` ``[1, RBLOCK]``; a value's
shape follows the loop variables it depends on, and a reduction's result is ``[XBLOCK, 1]``.
A bf16 softmax over 4096 rows of 1000 (buffers ``a`` and ``out``) compiles for the GPU to::

    @triton.jit
    def softmax_0(out_ptr, a_ptr, XBLOCK: tl.constexpr, RBLOCK: tl.constexpr):
        xnumel = 4096
        rnumel = 1000
        xoffset = tl.program_id(0) * XBLOCK
        xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
        rindex = tl.arange(0, RBLOCK)[None, :]
        rmask = rindex < rnumel
        tmp0 = tl.load(a_ptr + (1000*xindex + rindex), rmask, other=0).to(tl.float32)
        tmp1 = tl.where(rmask, tmp0, float("-inf"))
        tmp2 = tl.reduce(tmp1, 1, _kiln_maximum)[:, None]
        tmp3 = tmp0 - tmp2
        tmp4 = tl.exp(tmp3)
        tmp5 = tl.where(rmask, tmp4, 0)
        tmp6 = tl.sum(tmp5, 1)[:, None]
        tmp7 = tmp4 / tmp6
        tl.store(out_ptr + (1000*xindex + rindex), tmp7.to(tl.bfloat16), rmask)

with ``XBLOCK=4, RBLOCK=1024, num_warps=8`` and a header comment listing the fused nodes.
Masks appear only where a block overhangs its loop (``xnumel % XBLOCK != 0``, or an extent
is symbolic). A kernel of a program with symbolic sizes takes them as int arguments after the
pointers and the seed (``size_s0``, not specialized by Triton, so one binary serves every
size); its block sizes hold for a bucket of sizes (a power of two, guarded), and its grid is
an expression the launcher evaluates per size (``TritonSource.grid_text``). Values of
16-bit float type are float32 in registers (converted after the load and before the store).
Indices are int32 unless some buffer, loop extent or index term reaches 2**31.
"""

from __future__ import annotations

import keyword
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from kiln.codegen import triton_math as tm
from kiln.codegen.sources import Form, TritonSource
from kiln.errors import BackendError
from kiln.ir.op import Op
from kiln.ir.symbolic import Dim, Sym, Symbol, hint, printing_sizes
from kiln.schedule.index import INT32_LIMIT, FloorDiv, Index, Indirect, Mod, Var
from kiln.schedule.loops import (
    Apply,
    Const,
    Expr,
    IndexValue,
    Kernel,
    KernelKind,
    Load,
    R,
    Rand,
    Reduce,
    Store,
    X,
    children,
    depends_on_r,
    index_magnitudes,
    index_of,
    kernel_symbols,
    reduction_phase,
    walk,
)
from kiln.schedule.program import kernel_arguments

# ops whose spelling takes Python scalars as they are (operators, tl.where, tl.maximum)
INFIX_OPS = frozenset(
    {
        *(Op.ADD, Op.SUB, Op.MUL, Op.DIV, Op.NEG, Op.EQ, Op.NE, Op.LT, Op.LE, Op.GT, Op.GE),
        *(Op.BITWISE_AND, Op.BITWISE_OR, Op.BITWISE_XOR, Op.LOGICAL_AND, Op.LOGICAL_OR),
        *(Op.LOGICAL_XOR, Op.WHERE, Op.MAXIMUM, Op.MINIMUM),
    }
)
MAX_PERSISTENT_RBLOCK = 16384


@dataclass(frozen=True)
class Blocks:
    """Launch shape of one kernel: its form, block sizes and warps."""

    form: Form
    xblock: int
    rblock: int = 1
    num_warps: int = 4


class UnsupportedKernel(BackendError):
    """The Triton code generator cannot express a kernel (an op or dtype it lacks)."""


def next_power_of_2(n: Dim) -> int:
    """The smallest power of 2 at least ``n``; for a symbolic ``n``, its hint's, guarded to
    the bucket of sizes that share it."""
    if isinstance(n, Sym):
        power = next_power_of_2(n.hint)
        if n <= power and (power == 1 or n > power // 2):  # (both recorded as guards)
            return power
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def _at_most(cap: int, n: Dim) -> int:
    """``min(cap, next_power_of_2(n))``, guarding only ``n >= cap`` for a large size."""
    return cap if n >= cap else next_power_of_2(n)


def _clamp(value: int, low: int, high: int) -> int:
    return max(low, min(high, value))


def choose_blocks(kernel: Kernel, interpret: bool) -> Blocks:
    """Block sizes and warps from heuristics (``../shared/notes/codegen-facts.md`` §2-3).

    Interpreted kernels take bigger blocks: the interpreter costs milliseconds per program.
    """
    xnumel, rnumel = kernel.xnumel, kernel.rnumel
    if kernel.kind is KernelKind.POINTWISE:
        xblock = _at_most(8192 if interpret else 1024, xnumel)
        warps = _clamp(xblock // 256, 1, 8)
        return Blocks(Form.POINTWISE, xblock, 1, max(warps, 4) if xblock >= 128 else warps)
    rblock = next_power_of_2(rnumel)
    if rblock <= MAX_PERSISTENT_RBLOCK and (_rows_contiguous(kernel) or rblock <= 64):
        budget = 16384 if interpret else 4096
        xblock = _at_most(max(1, budget // rblock), xnumel)
        elements = xblock * rblock
        warps = 16 if rblock >= 8192 and not interpret else _clamp(elements // 512, 1, 8)
        return Blocks(Form.PERSISTENT, xblock, rblock, warps)
    if _rows_contiguous(kernel):  # long rows: a few rows, wide lanes
        return Blocks(Form.LOOPED, 1, min(rblock, 2048), 8)
    xblock = _at_most(64, xnumel)  # columns: coalesce along x
    return Blocks(Form.LOOPED, xblock, min(rblock, max(1, 4096 // xblock)), 8)


def _rows_contiguous(kernel: Kernel) -> bool:
    """Whether every load that walks along ``r`` steps by one element."""
    for expr in walk([s.value for s in kernel.stores]):
        if isinstance(expr, Load) and R in expr.offset.variables():
            steps = [c for atom, c in expr.offset.terms if isinstance(atom, Var) and atom.name == R]
            if steps != [1]:
                return False
    return True


def unsupported_reason(kernel: Kernel) -> str | None:
    """Why :func:`generate_triton` cannot handle ``kernel`` (None when it can)."""
    for expr in walk([s.value for s in kernel.stores]):
        if expr.dtype not in tm.TL_TYPES:
            return f"dtype {expr.dtype} has no Triton spelling"
        if isinstance(expr, Apply) and expr.op is not Op.CONVERT and expr.op not in tm.SPELLINGS:
            return f"op {expr.op.printed_name} has no Triton spelling"
        if isinstance(expr, Load) and expr.buffer.dtype not in tm.TL_TYPES:
            return f"buffer {expr.buffer.name} has dtype {expr.buffer.dtype}"
    for store in kernel.stores:
        if store.buffer.dtype not in tm.TL_TYPES:
            return f"buffer {store.buffer.name} has dtype {store.buffer.dtype}"
    return None


def generate_triton(
    kernel: Kernel, interpret: bool, *, blocks: Blocks | None = None, reshaped: bool = False
) -> TritonSource:
    """The Triton module of ``kernel``. ``interpret`` emits only what ``TRITON_INTERPRET=1``
    runs (no libdevice); ``blocks`` overrides :func:`choose_blocks` (tests use it to force
    tails and loops); ``reshaped``: the second form, for a kernel whose first one Triton
    failed to compile (``triton_math.kept``)."""
    reason = unsupported_reason(kernel)
    if reason is not None:
        raise UnsupportedKernel(f"kernel {kernel.name}: {reason}")
    blocks = blocks or choose_blocks(kernel, interpret)
    if kernel.kind is KernelKind.POINTWISE and blocks.form is not Form.POINTWISE:
        blocks = Blocks(Form.POINTWISE, blocks.xblock, 1, blocks.num_warps)
    if kernel.kind is KernelKind.REDUCTION and blocks.form is Form.POINTWISE:
        raise ValueError(f"kernel {kernel.name} reduces: a pointwise form cannot run it")
    sizes = kernel_symbols(kernel)
    with printing_sizes(_size_name if sizes else None):
        printer = _Printer(kernel, blocks, interpret, sizes=sizes, reshaped=reshaped)
        source = printer.module_source()
        programs = printer.programs + sum(p.programs for p in printer.parts)
        grid_text = str(programs) if isinstance(programs, Sym) else ""
    arguments = kernel_arguments(kernel)
    constexprs = {"XBLOCK": blocks.xblock}
    if blocks.form is not Form.POINTWISE:
        constexprs["RBLOCK"] = blocks.rblock
    grid = (hint(programs), 1, 1)
    return TritonSource(
        name=printer.function_name,
        kernel_name=kernel.name,
        source=source,
        arguments=tuple(b.name for b in arguments),
        argument_dtypes=tuple(b.dtype for b in arguments),
        has_seed=kernel.seed() is not None,
        constexprs=constexprs,
        num_warps=blocks.num_warps,
        grid=grid,
        form=blocks.form,
        interpret=interpret,
        sizes=tuple(_size_name(s) for s in sizes),
        grid_text=grid_text,
    )


def _size_name(symbol: Symbol) -> str:
    """A symbolic size's parameter in kernel source (and in ``TritonSource.grid_text``)."""
    return f"size_{symbol.name}"


def _identifier(name: str, taken: set[str]) -> str:
    text = re.sub(r"\W", "_", name) or "kernel"
    if text[0].isdigit() or keyword.iskeyword(text) or text in ("tl", "triton", "libdevice"):
        text = f"k_{text}"
    base, n = text, 1
    while text in taken:
        text, n = f"{base}_{n}", n + 1
    taken.add(text)
    return text


def _scalar_bool(text: str) -> str:
    """A 0-d comparison result the interpreter can broadcast: its handle keeps the operands'
    dtype, so splatting it to a block gives floats (Triton 3.9); ``&`` with a bool fixes it."""
    return f"tl.full([], True, tl.int1) & ({text})"


@dataclass
class _Reduction:
    """Names of one reduction's accumulators in a looped kernel."""

    value: str
    index: str = ""


@dataclass
class _Printer:
    kernel: Kernel
    blocks: Blocks
    interpret: bool
    lines: list[str] = field(default_factory=list)
    indent: int = 1
    scopes: list[dict[int, str]] = field(default_factory=lambda: [{}])
    counter: int = 0
    function_name: str = ""
    program: str = "tl.program_id(0)"  # a part's program number is its function's argument
    parts: list[_Printer] = field(default_factory=list)  # kiln/schedule/combine.py
    sizes: tuple[Symbol, ...] = ()  # the symbolic sizes it takes as arguments, after pointers
    reshaped: bool = False  # reductions made [XBLOCK, 1] by tl.reshape (triton_math.kept)

    def __post_init__(self) -> None:
        kernel = self.kernel
        self.roots = [s.value for s in kernel.stores]
        self.two_d = self.blocks.form is not Form.POINTWISE
        self.looped = self.blocks.form is Form.LOOPED
        self.dep_r = depends_on_r(self.roots)
        self.dims: dict[int, frozenset[str]] = {}
        self.literals: set[int] = set()
        for expr in walk(self.roots):
            self.dims[id(expr)] = self._dims_of(expr)
        # (a symbolic extent is masked at every size: no guard on divisibility)
        xnumel, rnumel = kernel.xnumel, kernel.rnumel
        self.xmask = isinstance(xnumel, Sym) or xnumel % self.blocks.xblock != 0
        self.rmask = self.two_d and (
            isinstance(rnumel, Sym) or rnumel % self.blocks.rblock != 0 or rnumel == 0
        )
        self.int64 = self._needs_int64()
        taken = {"tl", "triton", "libdevice", "seed", "seed_ptr"}
        self.pointers = {
            id(b): _identifier(f"{b.name}_ptr", taken) for b in kernel_arguments(kernel)
        }
        self.function_name = _identifier(kernel.name, set(tm.helper_names()) | taken)
        for part in kernel.parts:
            blocks = choose_blocks(part, self.interpret)
            printer = _Printer(
                part, blocks, self.interpret, sizes=self.sizes, reshaped=self.reshaped
            )
            printer.pointers = {id(b): self.pointers[id(b)] for b in kernel_arguments(part)}
            printer.function_name = _identifier(f"{self.function_name}_{part.name}", taken)
            self.parts.append(printer)

    @property
    def programs(self) -> Dim:
        """How many programs the kernel's own positions take."""
        return (self.kernel.xnumel + self.blocks.xblock - 1) // self.blocks.xblock

    # -- shapes and masks ---------------------------------------------------------------------

    def _index_dims(self, index: Index) -> frozenset[str]:
        dims = frozenset(index.variables() & {X, R})
        for atom in index.indirects():
            dims |= self.dims[id(atom.value)]
        return dims

    def _dims_of(self, expr: Expr) -> frozenset[str]:
        if isinstance(expr, Reduce):
            return frozenset({X})
        dims = frozenset().union(*(self._index_dims(i) for i in index_of(expr)))
        return dims.union(*(self.dims[id(c)] for c in children(expr)))

    def _shape(self, dims: frozenset[str]) -> str:
        if not self.two_d:
            return "[XBLOCK]" if X in dims else "[]"
        return f"[{'XBLOCK' if X in dims else 1}, {'RBLOCK' if R in dims else 1}]"

    def _tail_mask(self, dims: frozenset[str]) -> str | None:
        x = ["xmask"] if self.xmask and X in dims else []
        r = ["rmask"] if self.rmask and R in dims else []
        return " & ".join(x + r) or None

    def _needs_int64(self) -> bool:
        # Beyond the indices: lanes run past xnumel up to a whole block.
        kernel = self.kernel
        extents = [kernel.xnumel * max(kernel.rnumel, 1), kernel.xnumel + self.blocks.xblock]
        extents += [b.numel for b in kernel_arguments(kernel)]
        return max([*extents, *index_magnitudes(kernel)]) > INT32_LIMIT

    # -- text ----------------------------------------------------------------------------------

    def emit(self, line: str) -> None:
        self.lines.append("    " * self.indent + line)

    def fresh(self, prefix: str = "tmp") -> str:
        name = f"{prefix}{self.counter}"
        self.counter += 1
        return name

    def name(self, expr: Expr) -> str:
        for scope in reversed(self.scopes):
            if id(expr) in scope:
                return scope[id(expr)]
        raise KeyError(f"{type(expr).__name__} used before it was emitted")

    def emitted(self, expr: Expr) -> bool:
        return any(id(expr) in scope for scope in self.scopes)

    def bind(self, expr: Expr, text: str) -> str:
        """Assign ``text`` to a fresh name for ``expr`` in the current scope."""
        name = self.fresh()
        self.emit(f"{name} = {text}")
        self.scopes[-1][id(expr)] = name
        return name

    def typed(self, expr: Expr) -> str:
        """``expr``'s text as a tensor (literals become ``tl.full``)."""
        text = self.name(expr)
        if id(expr) in self.literals:
            return f"tl.full([], {text}, {tm.tl_type(tm.compute_dtype(expr.dtype))})"
        return text

    def index(self, index: Index) -> str:
        parts: list[str] = []
        order = {X: 0, R: 1}  # x before r, then the rest as the Index sorts them
        terms = sorted(index.terms, key=lambda t: order.get(getattr(t[0], "name", ""), 2))
        for atom, coef in terms:
            text = self._atom(atom)
            if isinstance(coef, Sym):  # (written as it is: its sign is its own)
                parts.append(f"+ ({coef})*{text}")
                continue
            term = text if abs(coef) == 1 else f"{abs(coef)}*{text}"
            parts.append(f"{'-' if coef < 0 else '+'} {term}")
        if isinstance(index.const, Sym):
            parts.append(f"+ ({index.const})")
        elif index.const or not parts:
            parts.append(f"{'-' if index.const < 0 else '+'} {abs(index.const)}")
        text = " ".join(parts)
        return text[2:] if text.startswith("+ ") else f"-{text[2:]}"

    def _atom(self, atom: object) -> str:
        if isinstance(atom, Var):
            return "xindex" if atom.name == X else "rindex"
        if isinstance(atom, Indirect) and atom.checked:
            # No check raises inside a GPU kernel without a sync (tl.device_assert runs only
            # under TRITON_DEBUG=1, as eager's CUDA asserts do): an index outside reads
            # element 0 instead of memory it does not own. The C++ kernels raise IndexError.
            name = self.name(atom.value)
            return f"tl.where(({name} >= 0) & ({name} < ({atom.size})), {name}, 0)"
        if isinstance(atom, Indirect):
            return self.name(atom.value)
        assert isinstance(atom, (FloorDiv, Mod))
        symbol = "//" if isinstance(atom, FloorDiv) else "%"
        inner = self.index(atom.operand)
        inner = inner if re.fullmatch(r"\w+", inner) else f"({inner})"
        return f"({inner} {symbol} ({atom.divisor}))"

    def pointer(self, buffer_id: int, offset: Index, dims: frozenset[str]) -> str:
        """``ptr + offset``, broadcast to ``dims`` when the offset varies along fewer."""
        text = self.index(offset)
        own = self._index_dims(offset)
        if own != dims:
            index_type = "tl.int64" if self.int64 else "tl.int32"
            text = f"{text} + tl.full({self._shape(dims)}, 0, {index_type})"
        pointer = self.pointers[buffer_id]
        if text == "0":
            return pointer
        return f"{pointer} + {text}" if re.fullmatch(r"\w+", text) else f"{pointer} + ({text})"

    # -- module ------------------------------------------------------------------------------

    def module_source(self) -> str:
        functions = self.combined_functions() if self.parts else [self.function(self.body())]
        text = "\n".join(functions)
        used = {n for n in re.findall(r"\b_kiln_\w+\b", text) if n in tm.helper_names()}
        helpers = tm.helper_sources(used, self.interpret)
        uses_libdevice = "libdevice." in text + "".join(helpers)
        imports = ["import triton", "import triton.language as tl"]
        if uses_libdevice:
            imports.append("from triton.language.extra import libdevice")
        parts = ["\n".join(self.header()), "\n".join(imports), *helpers, *functions]
        return "\n\n\n".join(parts) + "\n"

    def body(self) -> str:
        self.emit_body()
        return "\n".join(self.lines)

    def constexpr_params(self) -> list[str]:
        return ["XBLOCK: tl.constexpr"] + (["RBLOCK: tl.constexpr"] if self.two_d else [])

    def function(self, body: str, name: str = "", extra: tuple[str, ...] = ()) -> str:
        params = [self.pointers[id(b)] for b in kernel_arguments(self.kernel)]
        if self.kernel.seed() is not None:
            params.append("seed_ptr")
        sizes = [_size_name(s) for s in self.sizes]
        params += [*sizes, *extra, *self.constexpr_params()]
        # The seed is read through a pointer (a CUDA graph replays with a seed refreshed in
        # place); not specialized on alignment: a 0-d tensor may sit anywhere. Sizes are not
        # specialized either (on divisibility by 16): one binary serves every size.
        unspecialized = (["seed_ptr"] if "seed_ptr" in params else []) + sizes
        jit = "@triton.jit"
        if unspecialized:
            names = ", ".join(f'"{name}"' for name in unspecialized)
            jit += f"(do_not_specialize=[{names}])"
        return f"{jit}\ndef {name or self.function_name}({', '.join(params)}):\n{body}"

    def combined_functions(self) -> list[str]:
        """A kernel with parts: one function per kernel, taking its program number, and the
        launched function, which gives each its range of programs (the head's first)."""
        printers = [self, *self.parts]
        names = [f"{self.function_name}_main", *(p.function_name for p in self.parts)]
        functions = []
        for printer, name in zip(printers, names, strict=True):
            printer.program = "pid"
            functions.append(printer.function(printer.body(), name, ("pid",)))
        lines = ["    pid = tl.program_id(0)"]
        start: Dim = 0
        for number, (printer, name) in enumerate(zip(printers, names, strict=True)):
            arguments = [printer.pointers[id(b)] for b in kernel_arguments(printer.kernel)]
            arguments += [_size_name(s) for s in self.sizes]
            arguments.append(f"pid - {start}" if start else "pid")
            if printer is self:
                arguments += ["XBLOCK"] + (["RBLOCK"] if self.two_d else [])
            else:
                arguments += [str(printer.blocks.xblock)]
            start += printer.programs
            test = "if" if number == 0 else "elif"
            last = number == len(printers) - 1
            lines.append("    else:" if last else f"    {test} pid < {start}:")
            lines.append(f"        {name}({', '.join(arguments)})")
        launched = self.function("\n".join(lines))
        return [*functions, launched]

    def header(self) -> list[str]:
        kernel, blocks = self.kernel, self.blocks
        extent = f"x < {kernel.xnumel}" + (f", r < {kernel.rnumel}" if self.two_d else "")
        sizes = f"XBLOCK={blocks.xblock}" + (f", RBLOCK={blocks.rblock}" if self.two_d else "")
        mode = "TRITON_INTERPRET=1" if self.interpret else "GPU"
        lines = [
            f"# Kiln kernel {kernel.name}: {blocks.form.value} over {extent}",
            f"# {sizes}, num_warps={blocks.num_warps}, {'int64' if self.int64 else 'int32'}"
            f" indices, for {mode}",
        ]
        if kernel.fused:
            lines.append("# fused:")
            lines += [f"#   {entry}" for entry in kernel.fused]
        return lines

    # -- body --------------------------------------------------------------------------------

    def emit_body(self) -> None:
        kernel = self.kernel
        program = f"{self.program}.to(tl.int64)" if self.int64 else self.program
        if kernel.seed() is not None:
            self.emit("seed = tl.load(seed_ptr)")  # int64, as the scalar it replaced
        self.emit(f"xnumel = {kernel.xnumel}")
        if self.two_d:
            self.emit(f"rnumel = {kernel.rnumel}")
        self.emit(f"xoffset = {program} * XBLOCK")
        self.emit(f"xindex = xoffset + tl.arange(0, XBLOCK){'[:, None]' if self.two_d else ''}")
        if self.xmask:
            self.emit("xmask = xindex < xnumel")
        if not self.two_d:
            self.emit_exprs(walk(self.roots, left_to_right=True))
            self.emit_stores(kernel.stores)
            return
        if not self.looped:
            self.emit_rindex("")
            self.emit_exprs(walk(self.roots, left_to_right=True))
            self.emit_stores(kernel.stores)
            return
        self.emit_looped()

    def emit_rindex(self, offset: str) -> None:
        start = f"{offset} + " if offset else ""
        cast = ".to(tl.int64)" if self.int64 else ""
        self.emit(f"rindex = {start}tl.arange(0, RBLOCK)[None, :]{cast}")
        if self.rmask:
            self.emit("rmask = rindex < rnumel")

    def emit_exprs(self, exprs: Iterable[Expr]) -> None:
        for expr in exprs:
            if not self.emitted(expr):
                self.emit_expr(expr)

    def emit_looped(self) -> None:
        phase = reduction_phase(self.roots)
        reduces = [e for e in walk(self.roots) if isinstance(e, Reduce)]
        for k in range(1, max((phase[id(r)] for r in reduces), default=0) + 1):
            group = [r for r in reduces if phase[id(r)] == k]
            body = list(walk([r.value for r in group], into_reduces=False, left_to_right=True))
            self.emit_exprs(e for e in body if not self.dep_r[id(e)] and not isinstance(e, Reduce))
            accumulators = [self.init_accumulator(r) for r in group]
            self.open_loop()
            self.emit_exprs(e for e in body if self.dep_r[id(e)])
            for reduce, acc in zip(group, accumulators, strict=True):
                self.accumulate(reduce, acc)
            self.close_loop()
            for reduce, acc in zip(group, accumulators, strict=True):
                self.finish_accumulator(reduce, acc)
        row_stores = [s for s in self.kernel.stores if not self._row_shaped(s)]
        wide_stores = [s for s in self.kernel.stores if self._row_shaped(s)]
        self.emit_exprs(walk([s.value for s in row_stores], False, left_to_right=True))
        self.emit_stores(row_stores)
        if wide_stores:
            body = list(walk([s.value for s in wide_stores], False, left_to_right=True))
            self.emit_exprs(e for e in body if not self.dep_r[id(e)])
            self.open_loop()
            self.emit_exprs(e for e in body if self.dep_r[id(e)])
            self.emit_stores(wide_stores)
            self.close_loop()

    def open_loop(self) -> None:
        self.emit("for roffset in range(0, rnumel, RBLOCK):")
        self.indent += 1
        self.scopes.append({})
        self.emit_rindex("roffset")

    def close_loop(self) -> None:
        self.indent -= 1
        self.scopes.pop()

    def _row_shaped(self, store: Store) -> bool:
        return self.dep_r[id(store.value)] or R in self._index_dims(store.offset)

    def emit_stores(self, stores: list[Store]) -> None:
        for store in stores:
            if store.buffer.numel == 0:
                continue
            value = store.value
            dims = self.dims[id(value)] | self._index_dims(store.offset)
            if self.two_d and not self._row_shaped(store):
                dims = dims - {R}
            text = tm.narrow(
                self.typed(value), tm.compute_dtype(value.dtype), store.buffer.dtype, self.interpret
            )
            mask = self._tail_mask(dims)
            pointer = self.pointer(id(store.buffer), store.offset, dims)
            self.emit(f"tl.store({pointer}, {text}{f', {mask}' if mask else ''})")

    # -- expressions -------------------------------------------------------------------------

    def emit_expr(self, expr: Expr) -> None:
        if isinstance(expr, Const):
            self.emit_const(expr)
        elif isinstance(expr, IndexValue):
            kind = tm.tl_type(tm.compute_dtype(expr.dtype))
            if expr.index.is_constant:
                self.bind(expr, f"tl.full([], {expr.index.const}, {kind})")
            else:
                self.bind(expr, f"({self.index(expr.index)}).to({kind})")
        elif isinstance(expr, Load):
            self.emit_load(expr)
        elif isinstance(expr, Apply):
            self.emit_apply(expr)
        elif isinstance(expr, Reduce):
            self.emit_reduce(expr)
        elif isinstance(expr, Rand):  # counter = the offset as uint32 (wraps at 2**32)
            if expr.offset.terms:
                offset = f"({self.index(expr.offset)}).to(tl.uint32)"
            else:
                offset = f"tl.full([], {expr.offset.const % 2**32}, tl.uint32)"
            self.bind(expr, f"tl.{'randn' if expr.normal else 'rand'}(seed, {offset})")
        else:
            raise UnsupportedKernel(f"kernel {self.kernel.name}: no Triton form for {expr!r}")

    def constant(self, value: bool | int | float, dtype: torch.dtype) -> str:
        """A 0-d tensor of ``value`` in ``dtype``'s compute type."""
        dtype = tm.compute_dtype(dtype)
        return f"tl.full([], {tm.literal(value)}, {tm.tl_type(dtype)})"

    def emit_const(self, expr: Const) -> None:
        """Literals where Triton's own typing of Python scalars gives the dtype (fp32, int32,
        bool); typed tensors otherwise (a float64 literal would be rounded to fp32)."""
        dtype = tm.compute_dtype(expr.dtype)
        kind = bool if dtype == torch.bool else float if dtype.is_floating_point else int
        value = kind(expr.value)
        wide = kind is int and not -(2**31) <= value <= INT32_LIMIT  # Triton makes it int64
        if dtype == torch.float64 or dtype in tm.SMALL_INTS or (wide and dtype != torch.int64):
            self.bind(expr, self.constant(value, dtype))
            return
        self.scopes[-1][id(expr)] = tm.literal(value)
        self.literals.add(id(expr))

    def emit_load(self, expr: Load) -> None:
        dims = self.dims[id(expr)]
        mask = expr.mask
        never = mask is not None and id(mask) in self.literals and self.name(mask) == "False"
        if expr.buffer.numel == 0 or never:  # no valid (x, r) position reads it
            self.bind(expr, self.constant(expr.other, expr.dtype))
            return
        masks = [m for m in (self._tail_mask(dims),) if m]
        if mask is not None and id(mask) not in self.literals:
            masks.append(self.name(mask))
        pointer = self.pointer(id(expr.buffer), expr.offset, dims)
        args = [pointer]
        if masks:
            args.append(masks[0] if len(masks) == 1 else " & ".join(f"({m})" for m in masks))
            args.append(f"other={tm.literal(expr.other)}")
        text = f"tl.load({', '.join(args)})"
        if expr.buffer.dtype in (torch.float16, torch.bfloat16):
            text += ".to(tl.float32)"
        self.bind(expr, text)

    def emit_apply(self, expr: Apply) -> None:
        args = list(expr.args)
        if expr.op is Op.CONVERT:
            (operand,) = args
            source = tm.compute_dtype(operand.dtype)
            self.bind(expr, tm.convert(self.typed(operand), source, expr.dtype, self.interpret))
            return
        values = args[1:] if expr.op is Op.WHERE else args
        texts = [self.name(a) for a in args]
        dims = self.dims[id(expr)]
        if expr.op not in INFIX_OPS:  # functions and helpers take tensors of one shape
            texts = [self.typed(a) for a in args]
            if self.interpret:  # see _scalar_bool
                shape = self._shape(dims)
                texts = [
                    t if self.dims[id(a)] == dims else f"tl.broadcast_to({t}, {shape})"
                    for t, a in zip(texts, args, strict=True)
                ]
        elif all(id(a) in self.literals for a in values):  # a tensor to carry the type
            first = args.index(values[0])
            texts[first] = self.typed(values[0])
        consts = [a.value if isinstance(a, Const) else None for a in args]
        operands = tm.Operands(
            texts,
            tm.compute_dtype(values[0].dtype),
            tm.compute_dtype(expr.dtype),
            consts,
            self.interpret,
        )
        text = tm.SPELLINGS[expr.op](operands)
        if expr.dtype in tm.SMALL_INTS:  # keep 8/16-bit integer wrap-around
            text = f"({text}).to({tm.tl_type(expr.dtype)})"
        if self.interpret and expr.dtype == torch.bool and not dims:
            text = _scalar_bool(text)
        self.bind(expr, text)

    # -- reductions --------------------------------------------------------------------------

    def _reduce_type(self, reduce: Reduce) -> torch.dtype:
        """The dtype a reduction runs in (bool lanes count as int32)."""
        source = reduce.value.dtype if reduce.kind in tm.ARG_KINDS else reduce.dtype
        dtype = tm.compute_dtype(source)
        return torch.int32 if dtype == torch.bool else dtype

    def _operand(self, reduce: Reduce, dtype: torch.dtype) -> str:
        text = self.typed(reduce.value)
        same = tm.compute_dtype(reduce.value.dtype) == dtype
        return text if same else f"{text}.to({tm.tl_type(dtype)})"

    def emit_reduce(self, reduce: Reduce) -> None:
        """A persistent reduction: the whole row is one block of lanes."""
        dtype = self._reduce_type(reduce)
        kind = reduce.kind
        if self.kernel.rnumel == 0:  # an empty row: the identity (argmax/argmin: 0)
            empty = (
                (0, "tl.int64")
                if kind in tm.ARG_KINDS
                else (tm.reduce_identity(kind, dtype), tm.tl_type(dtype))
            )
            self.finish(reduce, f"tl.full([XBLOCK, 1], {empty[0]}, {empty[1]})", dtype)
            return
        value = self._operand(reduce, dtype)
        if self.rmask:
            value = f"tl.where(rmask, {value}, {tm.reduce_identity(kind, dtype)})"
        elif self.dims[id(reduce.value)] != frozenset({X, R}):
            value = f"tl.broadcast_to({value}, [XBLOCK, RBLOCK])"
        lanes = self.fresh()
        self.emit(f"{lanes} = {value}")
        self.reduce_lanes(reduce, dtype, lanes, "rindex", "rmask" if self.rmask else None)

    def reduce_lanes(
        self, reduce: Reduce, dtype: torch.dtype, lanes: str, indices: str, valid: str | None
    ) -> None:
        is_float = dtype.is_floating_point
        text = tm.reduce_lanes(reduce.kind, lanes, is_float, self.interpret, self.reshaped)
        if reduce.kind in tm.ARG_KINDS:
            extreme = self.fresh()
            self.emit(f"{extreme} = {text}")
            missing = self.kernel.rnumel
            text = tm.first_index(reduce.kind, lanes, extreme, indices, is_float, valid, missing)
        self.finish(reduce, text, dtype)

    def finish(self, reduce: Reduce, text: str, dtype: torch.dtype) -> None:
        target = tm.compute_dtype(reduce.dtype)
        if reduce.kind not in tm.ARG_KINDS and (target != dtype or dtype in tm.SMALL_INTS):
            text = f"({text}).to({tm.tl_type(target)})"
        self.bind(reduce, text)

    def init_accumulator(self, reduce: Reduce) -> _Reduction:
        dtype = self._reduce_type(reduce)
        acc = _Reduction(self.fresh("acc"))
        identity = tm.reduce_identity(reduce.kind, dtype)
        self.emit(f"{acc.value} = tl.full([XBLOCK, RBLOCK], {identity}, {tm.tl_type(dtype)})")
        if reduce.kind in tm.ARG_KINDS:
            acc.index = self.fresh("acc")
            rnumel, kind = self.kernel.rnumel, "tl.int64" if self.int64 else "tl.int32"
            self.emit(f"{acc.index} = tl.full([XBLOCK, RBLOCK], {rnumel}, {kind})")
        return acc

    def accumulate(self, reduce: Reduce, acc: _Reduction) -> None:
        dtype = self._reduce_type(reduce)
        is_float = dtype.is_floating_point
        value = self._operand(reduce, dtype)
        if not re.fullmatch(r"\w+", value):
            value = self.fresh()
            self.emit(f"{value} = {self._operand(reduce, dtype)}")
        if reduce.kind in tm.ARG_KINDS:
            missing = self.kernel.rnumel
            better = tm.better_lane(reduce.kind, value, acc.value, acc.index, is_float, missing)
            take = self.fresh("take")
            self.emit(f"{take} = rmask & ({better})" if self.rmask else f"{take} = {better}")
            self.emit(f"{acc.index} = tl.where({take}, rindex, {acc.index})")
            self.emit(f"{acc.value} = tl.where({take}, {value}, {acc.value})")
            return
        combined = tm.accumulate(reduce.kind, acc.value, value, is_float)
        if self.rmask:
            combined = f"tl.where(rmask, {combined}, {acc.value})"
        self.emit(f"{acc.value} = {combined}")

    def finish_accumulator(self, reduce: Reduce, acc: _Reduction) -> None:
        self.reduce_lanes(reduce, self._reduce_type(reduce), acc.value, acc.index, None)
