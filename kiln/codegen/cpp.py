"""C++/OpenMP code generation: a list of loop-level Kernels -> one C++ translation unit.

Every kernel becomes ``extern "C" void <name>(T0* a0, const T1* a1, ..., [int64_t seed],
[int64_t size_s0, ...])``, its pointer arguments in
:func:`~kiln.schedule.program.kernel_arguments` order (written buffers non-const). Shapes and
strides are constants of the index expressions (int32 unless an offset may not fit), or, in
a program with symbolic sizes, expressions of the ``size_*`` parameters. A pointwise kernel
is one loop over ``x`` vectorized with ``#pragma omp simd``, split into one chunk per thread
when the work is large (>= 32768 elements). A
reduction kernel runs over rows ``x`` in parallel and, per row, one loop over ``r`` per
reduction phase (``omp simd reduction(...)``; float max/min carry NaN in a flag), then a last
``r`` loop for row-shaped stores that need the last phase. Row-shaped subexpressions are
recomputed in each loop that needs them; per-row values are hoisted out of the ``r`` loops.
Two variants: few long rows run each ``r`` loop in parallel instead, and a reduction that
reads along columns (a sum over a leading dim) reduces a block of rows side by side,
vectorized across ``x`` (also a row kernel that only stores along ``r``). Softmax over 4096
rows of 1024 (``t0 = a1[r + 1024*x]``)::

    extern "C" void softmax_0(float* a0, const float* a1) {
      #pragma omp parallel for num_threads(2) schedule(static)
      for (int32_t x = 0; x < 4096; ++x) {
        float acc0 = -INFINITY; int nan_acc0 = 0;
        #pragma omp simd reduction(max:acc0) reduction(|:nan_acc0)
        for (int32_t r = 0; r < 1024; ++r) { const float t0 = a1[r + 1024*x]; ...; }
        const float t1 = nan_acc0 ? NAN : acc0; float acc1 = 0;
        #pragma omp simd reduction(+:acc1)
        for (int32_t r = 0; r < 1024; ++r) { ...; const float t3 = expf(t2); acc1 += t3; }
        const float t4 = acc1;
        #pragma omp simd
        for (int32_t r = 0; r < 1024; ++r) { ...; a0[r + 1024*x] = (t3 / t4); }
      }
    }

When ``x`` enumerates two dims through ``x // C`` and ``x % C`` (rows ``(n, c)`` of a
channels-last tensor; a flat BatchNorm-apply's per-channel values), the printer may split it
as ``x = lanes*xb + xl`` (:mod:`kiln.codegen.cpp_split`): such rows are columns contiguous
along ``xl``, and a flat kernel's values of ``xl`` alone are computed once into per-lane
arrays, those of ``xb`` alone once per block. Math spellings, conversions and the helper
prelude live in :mod:`kiln.codegen.cpp_math`.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from kiln.codegen import cpp_math, cpp_segments, cpp_split
from kiln.codegen.cpp_math import compute_type, storage_type
from kiln.codegen.cpp_reductions import SUM_CHUNK, Accumulator, accumulator_type
from kiln.codegen.cpp_segments import Segment
from kiln.codegen.cpp_split import XL, LaneSplit, PointwiseSplit
from kiln.codegen.sources import CppEntry, CppSource
from kiln.ir.op import Op
from kiln.ir.symbolic import Sym, Symbol, printing_sizes
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
    ReduceKind,
    Store,
    X,
    checks_indices,
    children,
    depends_on_r,
    index_magnitudes,
    kernel_symbols,
    reduction_phase,
    walk,
)
from kiln.schedule.program import kernel_arguments

PARALLEL_MIN_WORK = 32768  # elements (x * r) below which a kernel runs on one thread
COLUMN_BLOCK = 256  # rows reduced side by side when a reduction reads along columns
CAT_COLUMN_BLOCK = 1024  # ... over a channel cat: whole rows, one input a run of lanes reads
# A row-shaped transcendental two ``r`` loops need (softmax's exp) is kept in a per-row array
# by the first loop and read by the later ones, for rows up to this long (array on the stack).
ROW_CACHE_LIMIT = 16384
# Blocks count in 64 bits: GCC vectorized no lane loop whose 32-bit address it had to widen
# (a max pool's backward over 20x20 images; benchmarks/cpp_flags.py --set ...BLOCK_INDEX).
BLOCK_INDEX = "int64_t"
LANE_FLAG_LIMIT = 4096  # lanes of a block above which its flags stay scalar (stack arrays)
TRANSCENDENTAL = frozenset(
    {Op.EXP, Op.EXP2, Op.EXPM1, Op.LOG, Op.LOG1P, Op.LOG2, Op.TANH, Op.ERF, Op.SIGMOID, Op.POW}
)


def generate_cpp(kernels: list[Kernel], threads: int | None = None) -> str:
    """One C++ translation unit defining every kernel of ``kernels``; ``threads`` (default:
    ``torch.get_num_threads()``) is baked into the OpenMP pragmas."""
    count = torch.get_num_threads() if threads is None else max(int(threads), 1)
    return "\n".join([cpp_math.PRELUDE, *(_printed(k, count) for k in kernels)])


def _printed(kernel: Kernel, threads: int) -> str:
    """``kernel``'s function; symbolic sizes printed as its ``size_*`` parameters."""
    sized = bool(kernel_symbols(kernel))
    with printing_sizes(size_parameter if sized else None, "/"):  # (sizes are non-negative)
        return _KernelPrinter(kernel, threads).source()


def size_parameter(symbol: Symbol) -> str:
    """The parameter of a kernel that takes the symbolic size ``symbol``."""
    return f"size_{symbol.name}"


def cpp_library(
    kernels: list[Kernel], threads: int | None = None, source: str | None = None
) -> CppSource:
    """The translation unit of ``kernels`` (``source``: one already printed for them) with
    each kernel's entry point, what the runtime builds and binds."""
    entries = tuple(
        CppEntry(
            k.name,
            len(kernel_arguments(k)),
            k.seed() is not None,
            checks_indices(k),
            len(kernel_symbols(k)),
        )
        for k in kernels
    )
    name = kernels[0].name if kernels else "kernels"
    text = generate_cpp(kernels, threads) if source is None else source
    return CppSource(name, text, entries)


@dataclass(eq=False)
class _Block:
    """A C++ block being printed: its lines and the expressions defined in it."""

    indent: str
    parent: _Block | None = None
    lines: list[str] = field(default_factory=list)
    defined: set[int] = field(default_factory=set)
    constants: dict[int, bool] = field(default_factory=dict)  # a segment's masks

    def has(self, key: int) -> bool:
        block: _Block | None = self
        while block is not None:
            if key in block.defined:
                return True
            block = block.parent
        return False

    def add(self, line: str) -> None:
        self.lines.append(self.indent + line)

    def child(self) -> _Block:
        return _Block(self.indent + "  ", self)

    def close(self, child: _Block) -> None:
        """Append ``child`` (a block opened by this one's last line) and its closing brace."""
        self.lines += child.lines
        self.add("}")


class _KernelPrinter:
    """Prints one kernel as an ``extern "C"`` function."""

    def __init__(self, kernel: Kernel, threads: int) -> None:
        self.kernel = kernel
        self.threads = threads
        self.roots = [expr for store in kernel.stores for expr in _store_needs(store)]
        self.arguments = kernel_arguments(kernel)
        self.pointer = {id(b): f"a{i}" for i, b in enumerate(self.arguments)}
        self.names: dict[int, str] = {}
        self.index_type = "int64_t" if _needs_int64(kernel) else "int32_t"
        self.r_dependent = depends_on_r(self.roots)
        self.phase = reduction_phase(self.roots)
        self.work = kernel.xnumel * max(kernel.rnumel, 1)
        self.parallel = threads > 1 and self.work >= PARALLEL_MIN_WORK
        self.accumulators: dict[int, Accumulator] = {}
        self.row_cache: dict[int, str] = {}  # expression id -> the per-row array keeping it
        self.cached: set[int] = set()  # cached expressions an earlier r loop already stored
        self.caching: set[int] = set()  # those the current r loop stores
        self.split: LaneSplit | None = None  # x printed as lanes*xb + xl (kiln/codegen/cpp_split)
        self.lane_arrays: dict[int, str] = {}  # expression id -> the per-lane array keeping it
        self.across_rows: dict[int, bool] = {}  # in column reductions: varies along the block
        self.row_segments: list[Segment | None] = [None]  # rows' constant masks
        self.linkage = 'extern "C"'  # a part's own function is static
        self.sizes = kernel_symbols(kernel)  # (int64 parameters after the pointers and seed)
        self.divisors: dict[str, int] = {}  # symbolic divisor's text -> its kiln_divisor number
        self.prologue: list[str] = []  # lines before the body (the divisors' multipliers)

    # -- names and the signature ----------------------------------------------------------

    def name(self, expr: Expr) -> str:
        key = id(expr)
        if key not in self.names:
            self.names[key] = f"t{len(self.names)}"
        return self.names[key]

    def signature(self) -> str:
        written = {id(b) for b in self.kernel.writes()}
        params = []
        for buffer in self.arguments:
            const = "" if id(buffer) in written else "const "
            params.append(f"{const}{storage_type(buffer.dtype)}* {self.pointer[id(buffer)]}")
        if self.kernel.seed() is not None:
            params.append("int64_t seed")
        params += [f"int64_t {size_parameter(s)}" for s in self.sizes]
        return f"{self.linkage} void {self.kernel.name}({', '.join(params)})"

    def header(self) -> list[str]:
        kernel = self.kernel
        lines = [f"// kernel {kernel.name}: x < {kernel.xnumel}, r < {kernel.rnumel}"]
        for buffer in self.arguments:
            dtype = str(buffer.dtype).removeprefix("torch.")
            shape = ", ".join(str(s) for s in buffer.shape)
            lines.append(f"//   {self.pointer[id(buffer)]} = {buffer.name}: {dtype}[{shape}]")
        if self.split is not None:
            lines.append(f"// x = {self.split.lanes}*xb + xl")
        if kernel.fused:
            lines.append("// fused:")
            lines += [f"//   {node}" for node in kernel.fused]
        return lines

    def source(self) -> str:
        body = _Block("  ")
        if self.kernel.seed() is not None:
            body.add("const uint32_t key0 = (uint32_t)(uint64_t)seed;")
            body.add("const uint32_t key1 = (uint32_t)((uint64_t)seed >> 32);")
        if self.kernel.kind is KernelKind.POINTWISE:
            if self.kernel.rnumel == 0:  # x * r = 0 positions: nothing to store
                body.add("// empty: no positions to compute")
            else:
                self.pointwise(body)
        else:
            self.reduction(body)
        functions = []
        for part in self.kernel.parts:  # launched with this kernel (kiln/schedule/combine.py)
            printer = _KernelPrinter(part, self.threads)
            printer.linkage = "static"
            functions.append(printer.source())
            arguments = [self.pointer[id(b)] for b in printer.arguments]
            if printer.kernel.seed() is not None:
                arguments.append("seed")
            arguments += [size_parameter(s) for s in printer.sizes]
            body.add(f"{part.name}({', '.join(arguments)});")
        prologue = [f"  {line}" for line in self.prologue]
        head = [*self.header(), self.signature() + " {", *prologue, *body.lines, "}", ""]
        return "\n".join([*functions, *head])

    # -- expressions ----------------------------------------------------------------------

    def index(self, index: Index) -> str:
        return self.index_text(self.split.substitute(index) if self.split else index)

    def index_text(self, index: Index) -> str:
        parts: list[str] = []
        for atom, coef in index.terms:
            if isinstance(atom, Var):
                text = atom.name
            elif isinstance(atom, Indirect) and atom.checked:
                wrapped = int(atom.wrapped)
                checked = f"kiln_checked_index({self.name(atom.value)}, {atom.size}, {wrapped})"
                text = f"({self.index_type}){checked}"
            elif isinstance(atom, Indirect):
                text = f"({self.index_type}){self.name(atom.value)}"
            elif isinstance(atom.divisor, Sym) and self.index_type == "int32_t":
                operand = f"({self.index_text(atom.operand)})"
                divisor, value = self.runtime_divisor(atom.divisor)
                quotient = f"kiln_div({operand}, {divisor})"
                text = (
                    quotient if isinstance(atom, FloorDiv) else f"({operand} - {quotient}*{value})"
                )
            else:
                operator = "/" if isinstance(atom, FloorDiv) else "%"
                assert isinstance(atom, (FloorDiv, Mod))
                text = f"(({self.index_text(atom.operand)}) {operator} {atom.divisor})"
            parts.append(text if coef == 1 else f"{coef}*{text}")
        if index.const or not parts:
            parts.append(str(index.const))
        return " + ".join(parts).replace("+ -", "- ")

    def runtime_divisor(self, size: Sym) -> tuple[str, str]:
        """Names of a symbolic divisor's precomputed multiplier and of its value (kiln_div),
        defined once at the top of the function."""
        text = str(size)
        if text not in self.divisors:
            number = len(self.divisors)
            self.divisors[text] = number
            self.prologue.append(f"const kiln_divisor dv{number} = kiln_divisor_of({text});")
            self.prologue.append(f"const int32_t dn{number} = (int32_t)({text});")
        number = self.divisors[text]
        return f"dv{number}", f"dn{number}"

    def render(self, expr: Expr) -> str:
        """The C++ text of ``expr``, its operands already named."""
        if isinstance(expr, Const):
            return cpp_math.literal(expr.value, expr.dtype)
        if isinstance(expr, IndexValue):
            return f"({compute_type(expr.dtype)})({self.index(expr.index)})"
        if isinstance(expr, Load):
            pointer = self.pointer[id(expr.buffer)]
            text = cpp_math.load(f"{pointer}[{self.index(expr.offset)}]", expr.buffer.dtype)
            text = cpp_math.convert(text, expr.buffer.dtype, expr.dtype)
            if expr.mask is None:
                return text
            other = cpp_math.literal(expr.other, expr.dtype)
            return f"{self.operand(expr.mask)} ? {text} : {other}"
        if isinstance(expr, Rand):
            helper = "kiln_randn" if expr.normal else "kiln_rand"
            text = f"{helper}((uint32_t)({self.index(expr.offset)}), key0, key1)"
            return cpp_math.convert(text, torch.float32, expr.dtype)
        if isinstance(expr, Apply):
            args = [self.operand(arg) for arg in expr.args]
            if expr.op is Op.CONVERT:
                return cpp_math.convert(args[0], expr.args[0].dtype, expr.dtype)
            operand_dtype = expr.args[-1].dtype
            return cpp_math.spell(expr.op, args, operand_dtype)
        raise TypeError(f"cannot print {type(expr).__name__} here")

    def operand(self, expr: Expr) -> str:
        if isinstance(expr, Const):
            return cpp_math.literal(expr.value, expr.dtype)
        return self.name(expr)

    def emit(
        self,
        roots: list[Expr],
        block: _Block,
        row: _Block | None = None,
        varies: dict[int, bool] | None = None,
    ) -> None:
        """Define every expression ``roots`` need in ``block`` (operands first). Inside an
        inner loop, the values that do not vary along it (``varies``, by default along ``r``)
        go to ``row``, the block around the loop; values kept in per-lane arrays are read
        from them."""
        varies = self.r_dependent if varies is None else varies
        stack: list[tuple[Expr, bool]] = [(root, False) for root in reversed(roots)]
        while stack:
            expr, expanded = stack.pop()
            folded = cpp_segments.folded(expr, block.constants)  # (a segment's constant mask)
            target = block
            if row is not None and folded is None and not varies.get(id(expr), True):
                target = row
            if target.has(id(expr)) or isinstance(expr, Const):
                continue
            if isinstance(expr, Reduce):
                raise AssertionError(f"{self.kernel.name}: a reduction used before its loop")
            if id(expr) in self.lane_arrays:
                slot = f"{self.lane_arrays[id(expr)]}[{self.lane}]"
                target.add(f"const {compute_type(expr.dtype)} {self.name(expr)} = {slot};")
                target.defined.add(id(expr))
                continue
            array = self.row_cache.get(id(expr)) if target is block and row is not None else None
            if array is not None and id(expr) in self.cached:  # computed by an earlier loop
                target.add(f"const {compute_type(expr.dtype)} {self.name(expr)} = {array}[r];")
                target.defined.add(id(expr))
                continue
            if not expanded:
                stack.append((expr, True))
                needs = children(expr) if folded is None else (folded,)
                stack += [(child, False) for child in reversed(needs)]
                continue
            text = self.render(expr) if folded is None else self.operand(folded)
            target.add(f"const {compute_type(expr.dtype)} {self.name(expr)} = {text};")
            target.defined.add(id(expr))
            if array is not None:
                target.add(f"{array}[r] = {self.name(expr)};")
                self.caching.add(id(expr))

    def store_phase(self, store: Store) -> int:
        return max(self.phase[id(expr)] for expr in _store_needs(store))

    def per_position(self, store: Store) -> bool:
        """Whether ``store`` runs for every ``(x, r)`` (else once per row)."""
        needs = _store_needs(store)
        return R in store.offset.variables() or any(self.r_dependent[id(e)] for e in needs)

    def store(self, store: Store, block: _Block) -> None:
        value = self.operand(store.value)
        value = cpp_math.convert(value, store.value.dtype, store.buffer.dtype)
        pointer = self.pointer[id(store.buffer)]
        text = cpp_math.store(value, store.buffer.dtype)
        block.add(f"{pointer}[{self.index(store.offset)}] = {text};")

    # -- loops ----------------------------------------------------------------------------

    def pointwise(self, body: _Block) -> None:
        xnumel, t = self.kernel.xnumel, self.index_type
        min_blocks = self.threads if self.parallel else 1
        split = cpp_split.pointwise_split(xnumel, self.roots, min_blocks)
        if split is not None:
            self.split_pointwise(body, split)
            return
        if self.parallel:
            chunk = (xnumel + self.threads - 1) // self.threads
            chunk = (chunk + 63) // 64 * 64
            body.add(f"#pragma omp parallel for num_threads({self.threads}) schedule(static)")
            body.add(f"for ({t} x0 = 0; x0 < {xnumel}; x0 += {chunk}) {{")
            outer = body.child()
            outer.add(f"const {t} x1 = x0 + {chunk} < {xnumel} ? x0 + {chunk} : {xnumel};")
            outer.add("#pragma omp simd")
            outer.add(f"for ({t} x = x0; x < x1; ++x) {{")
            inner = outer.child()
            self.pointwise_body(inner)
            outer.close(inner)
            body.close(outer)
            return
        body.add("#pragma omp simd")
        body.add(f"for ({t} x = 0; x < {xnumel}; ++x) {{")
        inner = body.child()
        self.pointwise_body(inner)
        body.close(inner)

    def split_pointwise(self, body: _Block, plan: PointwiseSplit) -> None:
        """Blocks ``xb`` (in parallel) of a vectorized loop over lanes ``xl``: values of ``xl``
        alone (a channels-last BatchNorm's per-channel scale) come from per-lane arrays filled
        once, values of ``xb`` alone (an NCHW one's) are computed once per block."""
        self.split = plan.split
        lanes = plan.split.lanes
        segments = cpp_segments.lane_segments(plan.split, plan.lane_values)
        if segments is None:  # one loop over every lane
            segments = [Segment(0, lanes, {})]
        constant = segments[0].constants
        lane_values = [v for v in plan.lane_values if id(v) not in constant]
        if lane_values:
            assert isinstance(lanes, int)  # (pointwise_split: per-lane arrays of a known size)
            self.fill_lane_arrays(body, lane_values, lanes)
        if self.parallel:
            body.add(f"#pragma omp parallel for num_threads({self.threads}) schedule(static)")
        body.add(f"for ({BLOCK_INDEX} xb = 0; xb < {plan.split.blocks}; ++xb) {{")
        outer = body.child()
        sized = isinstance(lanes, int) and lanes <= LANE_FLAG_LIMIT  # (arrays of lanes)
        flags = cpp_split.block_flags(self.roots, plan) if sized else []
        names = [f"flag{number}" for number in range(len(flags))]
        if flags:  # each read in the lane loop from a per-lane copy (``cpp_split.block_flags``)
            self.emit(flags, outer)
            outer.add(f"uint8_t {', '.join(f'{name}[{lanes}]' for name in names)};")
            outer.add("#pragma omp simd")
            copies = " ".join(
                f"{n}[{XL}] = {self.name(f)};" for n, f in zip(names, flags, strict=True)
            )
            outer.add(f"for (int32_t {XL} = 0; {XL} < {lanes}; ++{XL}) {{ {copies} }}")
        for segment in segments:  # kiln/codegen/cpp_segments.py: masks constant in each
            inner = outer.child()
            for name, flag in zip(names, flags, strict=True):
                ctype = compute_type(flag.dtype)
                inner.add(f"const {ctype} {self.name(flag)} = {name}[{XL}];")  # (shadows it)
                inner.defined.add(id(flag))
            self.define_constants(inner, segment)
            self.emit(self.roots, inner, outer, plan.on_lane)
            for store in self.kernel.stores:
                self.store(store, inner)
            outer.add("#pragma omp simd")
            outer.add(f"for (int32_t {XL} = {segment.start}; {XL} < {segment.stop}; ++{XL}) {{")
            outer.close(inner)
        body.close(outer)

    def define_constants(self, block: _Block, segment: Segment | None) -> None:
        """The masks ``segment`` holds constant, known to ``block``: a value that still needs
        one prints it as a literal there, a select on one prints only the operand it takes."""
        block.constants.update(segment.constants if segment else {})

    @property
    def lane(self) -> str:
        """The C++ index of the current row within its block of rows."""
        return XL if self.split else "x - x0"

    def lane_loop(self, rows: Segment | None = None) -> str:
        """The head of a (vectorized) loop over the rows of one block (those of ``rows``)."""
        if self.split:
            start, stop = (0, self.split.lanes) if rows is None else (rows.start, rows.stop)
            return f"for (int32_t {XL} = {start}; {XL} < {stop}; ++{XL}) {{"
        if rows is None:
            return f"for ({self.index_type} x = x0; x < x1; ++x) {{"
        t, a, b = self.index_type, rows.start, rows.stop
        return f"for ({t} x = (x0 > {a} ? x0 : {a}); x < (x1 < {b} ? x1 : {b}); ++x) {{"

    def fill_lane_arrays(self, block: _Block, values: list[Expr], lanes: int) -> None:
        """One array slot per row of a block for each of ``values``, filled by one loop over
        the block's rows; later loops over them read the arrays instead of recomputing."""
        names = {id(value): f"lane{number}" for number, value in enumerate(values)}
        for value in values:
            block.add(f"{compute_type(value.dtype)} {names[id(value)]}[{lanes}];")
        block.add("#pragma omp simd")
        block.add(self.lane_loop())
        inner = block.child()
        self.emit(values, inner)
        for value in values:
            inner.add(f"{names[id(value)]}[{self.lane}] = {self.name(value)};")
        block.close(inner)
        self.lane_arrays = names

    def pointwise_body(self, block: _Block) -> None:
        self.emit(self.roots, block)
        for store in self.kernel.stores:
            self.store(store, block)

    def reduction(self, body: _Block) -> None:
        """Rows in parallel (or, for few long rows, each ``r`` loop in parallel); per row one
        ``r`` loop per reduction phase, per-row stores after the phase that completes them,
        row-shaped stores in the first loop that can compute them."""
        kernel, t = self.kernel, self.index_type
        reduces = [e for e in walk(self.roots) if isinstance(e, Reduce)]
        phases = max((self.phase[id(r)] for r in reduces), default=0)
        has_arg = any(r.kind in {ReduceKind.ARGMAX, ReduceKind.ARGMIN} for r in reduces)
        r_stores = [s for s in kernel.stores if self.per_position(s)]
        if not has_arg and self.reads_columns(reduces, r_stores):
            self.column_reduction(body, reduces, r_stores, phases)
            return
        split_rows = self.parallel and kernel.xnumel < self.threads and not has_arg
        if self.parallel and not split_rows:
            body.add(f"#pragma omp parallel for num_threads({self.threads}) schedule(static)")
        body.add(f"for ({t} x = 0; x < {kernel.xnumel}; ++x) {{")
        row = body.child()
        if not split_rows:
            self.plan_row_cache(reduces, r_stores, phases, row)
        row_stores = [s for s in kernel.stores if not self.per_position(s)]
        self.row_stores(row_stores, 0, row)
        for loop in range(1, phases + 2):
            loop_reduces = [r for r in reduces if self.phase[id(r)] == loop]
            stores = [s for s in r_stores if self.store_phase(s) + 1 == loop]
            if loop_reduces or stores:
                self.r_loop(loop_reduces, stores, row, split_rows)
            self.row_stores(row_stores, loop, row)
        body.close(row)

    def plan_row_cache(
        self, reduces: list[Reduce], r_stores: list[Store], phases: int, row: _Block
    ) -> None:
        """Per-row arrays for row-shaped transcendentals that more than one ``r`` loop needs:
        softmax's ``exp(x - max)`` is computed once per element, not once per loop."""
        if self.kernel.rnumel > ROW_CACHE_LIMIT:
            return
        loops_of: dict[int, set[int]] = {}
        for loop in range(1, phases + 2):
            roots = [r.value for r in reduces if self.phase[id(r)] == loop]
            roots += [
                e for s in r_stores if self.store_phase(s) + 1 == loop for e in _store_needs(s)
            ]
            for expr in walk(roots, into_reduces=False):
                if (
                    isinstance(expr, Apply)
                    and expr.op in TRANSCENDENTAL
                    and self.r_dependent[id(expr)]
                ):
                    loops_of.setdefault(id(expr), set()).add(loop)
        shared = [key for key, loops in loops_of.items() if len(loops) > 1]
        for number, key in enumerate(shared):
            self.row_cache[key] = f"row{number}"
        for expr in walk(self.roots):
            if id(expr) in self.row_cache:
                row.add(
                    f"{compute_type(expr.dtype)} {self.row_cache[id(expr)]}[{self.kernel.rnumel}];"
                )

    def reads_columns(self, reduces: list[Reduce], r_stores: list[Store]) -> bool:
        """Whether the values the ``r`` loops compute read along columns: some read varying
        along ``r`` is contiguous in ``x`` and none in ``r`` (a sum over a leading dim), so
        rows are reduced (or stored) a block at a time, vectorized across ``x``. Rows ``(n,
        c)`` of a channels-last tensor are columns split as ``lanes*xb + xl`` (``split``)."""
        if self.kernel.xnumel < 16:
            return False
        stored = [e for s in r_stores for e in _store_needs(s)]
        offsets = [
            expr.offset
            for expr in walk([r.value for r in reduces] + stored)
            if isinstance(expr, (Load, Rand)) and R in expr.offset.variables()
        ]
        if cpp_split.reads_columns(offsets, X):
            return True
        min_blocks = self.threads if self.parallel else 1
        cat = any(isinstance(e, Load) and e.mask is not None for e in walk(self.roots))
        most = CAT_COLUMN_BLOCK if cat else COLUMN_BLOCK
        self.split = cpp_split.column_split(self.kernel.xnumel, offsets, most, min_blocks)
        return self.split is not None

    def column_reduction(
        self, body: _Block, reduces: list[Reduce], r_stores: list[Store], phases: int
    ) -> None:
        """Blocks of rows (in parallel), each reduced by one ``r`` loop per phase around a
        vectorized loop over the block's rows, with one accumulator slot per row (a later
        phase reads an earlier one's result from its slot: a variance's mean); then per-row
        stores. A BatchNorm's statistics over channels-last ``[N*H*W, C]`` are such columns,
        and so, split by ``x = lanes*xb + xl``, are its sums per ``(n, c)``. Values the ``r``
        loops need that vary along the rows only are computed once per block into per-lane
        arrays."""
        kernel, t = self.kernel, self.index_type
        outer, lanes = self.column_blocks(body)
        self.across_rows = cpp_split.varies_across_rows(self.roots, self.split)
        invariants = cpp_split.loop_invariants(
            [r.value for r in reduces] + [e for s in r_stores for e in _store_needs(s)],
            self.r_dependent,
        )
        # (one the same for every row, a constant, is computed where it is read instead)
        invariants = [e for e in invariants if self.phase[id(e)] == 0 and self.across_rows[id(e)]]
        segments = (
            cpp_segments.lane_segments(self.split, invariants, cpp_segments.MAX_ROW_SEGMENTS)
            if self.split
            else cpp_segments.row_segments(kernel.xnumel, invariants)
        )
        if segments:  # one loop per run of rows reading one input of a cat (cpp_segments.py)
            self.row_segments = list(segments)
            invariants = [e for e in invariants if id(e) not in segments[0].constants]
        if invariants:  # a BatchNorm's per-channel scale and shift, once per block
            self.fill_lane_arrays(outer, invariants, lanes)
        accumulators = [self.accumulator(reduce) for reduce in reduces]
        variables = [v for acc in accumulators for v in acc.variables()]
        for ctype, name, _ in variables:
            outer.add(f"{ctype} {name}[{lanes}];")
        if variables:
            outer.add(f"for (int lane = 0; lane < {lanes}; ++lane) {{")
            for _, name, initial in variables:
                outer.add(f"  {name}[lane] = {initial};")
            outer.add("}")
        for loop in range(1, phases + 2):
            updating = [a for a in accumulators if self.phase[id(a.reduce)] == loop]
            finished = [a for a in accumulators if self.phase[id(a.reduce)] < loop]
            stores = [s for s in r_stores if self.store_phase(s) + 1 == loop]
            if not updating and not stores:
                continue
            chunked = [a for a in updating if a.cascades] if self.long_rows() else []
            around, first = outer, "0"
            if chunked:  # (partials of chunks: SUM_CHUNK)
                around, first = self.open_chunk(outer, lanes, chunked), "r0"
            around.add(f"for ({t} r = {first}; r < {'r1' if chunked else kernel.rnumel}; ++r) {{")
            per_r = around.child()
            self.x_loop(per_r, stores, updating, finished, {id(a) for a in chunked})
            around.close(per_r)
            if chunked:
                around.add(f"for (int lane = 0; lane < {lanes}; ++lane) {{")
                for acc in chunked:
                    around.add(f"  {acc.name}[lane] += part_{acc.name}[lane];")
                around.add("}")
                outer.close(around)
        row_stores = [s for s in kernel.stores if s not in r_stores]
        if row_stores:
            self.x_loop(outer, row_stores, [], accumulators)
        body.close(outer)

    def long_rows(self) -> bool:
        """Whether rows may be longer than a chunk of a cascaded sum (``SUM_CHUNK``)."""
        rnumel = self.kernel.rnumel
        return not isinstance(rnumel, int) or rnumel > 2 * SUM_CHUNK

    def open_chunk(
        self, outer: _Block, lanes: int, chunked: list[Accumulator], header: bool = True
    ) -> _Block:
        """Opens the loop over chunks ``r0 <= r < r1`` of the rows, whose body starts with
        the chunked accumulators' partials at zero; returns the body (``header`` False: the
        caller adds the loop's line, :meth:`chunk_header`, after what it hoists to ``outer``)."""
        t, rnumel = self.index_type, self.kernel.rnumel
        if header:
            outer.add(self.chunk_header())
        chunk = outer.child()
        chunk.add(f"const {t} r1 = r0 + {SUM_CHUNK} < {rnumel} ? r0 + {SUM_CHUNK} : {rnumel};")
        if not lanes:  # (a row's partials: scalars)
            for acc in chunked:
                chunk.add(f"{acc.acc_type} part_{acc.name} = 0;")
            return chunk
        for acc in chunked:
            chunk.add(f"{acc.acc_type} part_{acc.name}[{lanes}];")
        chunk.add(f"for (int lane = 0; lane < {lanes}; ++lane) {{")
        for acc in chunked:
            chunk.add(f"  part_{acc.name}[lane] = 0;")
        chunk.add("}")
        return chunk

    def chunk_header(self) -> str:
        rnumel = self.kernel.rnumel
        return f"for ({self.index_type} r0 = 0; r0 < {rnumel}; r0 += {SUM_CHUNK}) {{"

    def column_blocks(self, body: _Block) -> tuple[_Block, int]:
        """Opens the loop over blocks of rows (in parallel): ``x0 <= x < x1``, or the block
        ``xb`` of a split; returns the block's body and its number of rows."""
        t, xnumel = self.index_type, self.kernel.xnumel
        if self.parallel:
            body.add(f"#pragma omp parallel for num_threads({self.threads}) schedule(static)")
        if self.split is not None:
            body.add(f"for ({t} xb = 0; xb < {self.split.blocks}; ++xb) {{")
            assert isinstance(self.split.lanes, int)  # (column splits: cpp_split.column_split)
            return body.child(), self.split.lanes
        lanes = (xnumel + self.threads - 1) // self.threads if self.parallel else xnumel
        lanes = int(min(COLUMN_BLOCK, (lanes + 15) // 16 * 16))  # (arrays: a size guarded)
        body.add(f"for ({t} x0 = 0; x0 < {xnumel}; x0 += {lanes}) {{")
        outer = body.child()
        outer.add(f"const {t} x1 = x0 + {lanes} < {xnumel} ? x0 + {lanes} : {xnumel};")
        return outer, lanes

    def x_loop(
        self,
        block: _Block,
        stores: list[Store],
        updating: list[Accumulator],
        finished: list[Accumulator],
        chunked: Collection[int] = (),  # (ids of accumulators updated through partials)
    ) -> None:
        """A vectorized loop over the rows of a block: it reads the results of the ``finished``
        accumulators, updates the ``updating`` ones (inside an ``r`` loop), then runs
        ``stores``."""
        for segment in self.row_segments:
            inner = block.child()
            self.define_constants(inner, segment)
            slot = f"[{self.lane}]"
            for acc in finished:
                ctype = compute_type(acc.reduce.dtype)
                inner.add(f"const {ctype} {self.name(acc.reduce)} = {acc.result(slot)};")
                inner.defined.add(id(acc.reduce))
            values = [acc.reduce.value for acc in updating]
            needs = values + [e for s in stores for e in _store_needs(s)]
            self.emit(needs, inner, block, self.across_rows)  # a row's own values once per r
            for acc in updating:
                into = f"part_{acc.name}" if id(acc) in chunked else ""
                for line in acc.update(self.operand(acc.reduce.value), slot, into):
                    inner.add(line)
            for store in stores:
                self.store(store, inner)
            block.add("#pragma omp simd")
            block.add(self.lane_loop(segment))
            block.close(inner)

    def row_stores(self, stores: list[Store], phase: int, row: _Block) -> None:
        done = [s for s in stores if self.store_phase(s) == phase]
        self.emit([e for s in done for e in _store_needs(s)], row)
        for store in done:
            self.store(store, row)

    def accumulator(self, reduce: Reduce) -> Accumulator:
        acc = Accumulator(
            reduce,
            f"acc{len(self.accumulators)}",
            compute_type(reduce.value.dtype),
            accumulator_type(reduce),
        )
        self.accumulators[id(reduce)] = acc
        return acc

    def r_loop(self, reduces: list[Reduce], stores: list[Store], row: _Block, split: bool) -> None:
        accumulators = [self.accumulator(reduce) for reduce in reduces]
        for acc in accumulators:
            for ctype, name, initial in acc.variables():
                row.add(f"{ctype} {name} = {initial};")
        chunked = [a for a in accumulators if a.cascades] if self.long_rows() and not split else []
        around = self.open_chunk(row, 0, chunked, header=False) if chunked else row
        loop = around.child()
        needs = [e for s in stores for e in _store_needs(s)]
        self.emit([r.value for r in reduces] + needs, loop, row)  # (hoists to row)
        if chunked:
            row.add(self.chunk_header())
        for acc in accumulators:
            into = f"part_{acc.name}" if acc in chunked else ""
            for line in acc.update(self.operand(acc.reduce.value), into=into):
                loop.add(line)
        for store in stores:
            self.store(store, loop)
        clauses = [
            c.replace(f":{acc.name})", f":part_{acc.name})") if acc in chunked else c
            for acc in accumulators
            for c in acc.clauses()
        ]
        vectorize = all(acc.clauses() for acc in accumulators)  # no ARGMAX/ARGMIN
        pragma = " ".join(["omp simd", *clauses]) if vectorize else ""
        if split:
            schedule = f"num_threads({self.threads}) schedule(simd:static)"
            pragma = " ".join(["omp parallel for simd", schedule, *clauses])
        if pragma:
            around.add(f"#pragma {pragma}")
        bounds = "r = r0; r < r1" if chunked else f"r = 0; r < {self.kernel.rnumel}"
        around.add(f"for ({self.index_type} {bounds}; ++r) {{")
        around.close(loop)
        if chunked:
            for acc in chunked:
                around.add(f"{acc.name} += part_{acc.name};")
            row.close(around)
        self.cached |= self.caching
        self.caching = set()
        for acc in accumulators:
            ctype = compute_type(acc.reduce.dtype)
            row.add(f"const {ctype} {self.name(acc.reduce)} = {acc.result()};")
            row.defined.add(id(acc.reduce))


def _store_needs(store: Store) -> list[Expr]:
    """What a store evaluates: its value and the index values of its offset (a scatter)."""
    return [store.value, *(atom.value for atom in store.offset.indirects())]


def _needs_int64(kernel: Kernel) -> bool:
    """Whether an index (or a partial sum of one) may leave int32; beyond the indices, the
    loop extents (with room for the vector tail) count."""
    extents = [kernel.xnumel * max(kernel.rnumel, 1) + 64 * 16, 2 * kernel.xnumel]
    extents.append(2 * kernel.rnumel)
    return max([*extents, *index_magnitudes(kernel)]) > INT32_LIMIT
