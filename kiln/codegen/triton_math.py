"""How the Triton code generator spells each elementwise op, and the helper functions it needs.

One table row per :class:`~kiln.ir.op.Op`: given the operands' Triton text (names or literals),
their compute dtype and whether the kernel is meant for the interpreter, a row returns the
expression text. Values are in *compute* dtypes (float16/bfloat16 are float32 in registers).

Two spellings exist for a few functions. Compiled for a GPU, functions ``tl`` lacks come from
``libdevice`` (tanh, erfinv, log1p, expm1, asin/acos/atan/atan2, sinh/cosh, tan, pow, fmod,
rint). ``TRITON_INTERPRET=1`` cannot run any libdevice call (triton issue #8825), so interpreter
kernels call the ``_kiln_*`` helpers below instead: fp32-accurate compositions of ``tl``
primitives (Kahan's expm1/log1p, Cephes' atanf, Giles' erfinv plus a Newton step, ...). The
helpers are ``@triton.jit`` functions emitted into the kernel's module when used.

Reductions are spelled here too: identities for masked lanes, the NaN-propagating max/min
(``tl.max`` ignores NaN), first-index argmax/argmin, and the per-lane loop steps.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kiln.ir.op import Op
from kiln.schedule.loops import ReduceKind

TL_TYPES: dict[torch.dtype, str] = {
    torch.float32: "tl.float32",
    torch.float64: "tl.float64",
    torch.float16: "tl.float16",
    torch.bfloat16: "tl.bfloat16",
    torch.int8: "tl.int8",
    torch.uint8: "tl.uint8",
    torch.int16: "tl.int16",
    torch.int32: "tl.int32",
    torch.int64: "tl.int64",
    torch.bool: "tl.int1",
}
SMALL_INTS = frozenset({torch.int8, torch.uint8, torch.int16})
INT_BITS = {torch.int8: 8, torch.uint8: 8, torch.int16: 16, torch.int32: 32, torch.int64: 64}


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a value of ``dtype`` has in registers: 16-bit floats are computed in fp32."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def tl_type(dtype: torch.dtype) -> str:
    return TL_TYPES[dtype]


def literal(value: bool | int | float) -> str:
    """Python/Triton source of a scalar constant."""
    if isinstance(value, bool):
        return "True" if value else "False"
    if isinstance(value, float):
        if value != value:
            return 'float("nan")'
        if value in (float("inf"), float("-inf")):
            return 'float("inf")' if value > 0 else 'float("-inf")'
        return repr(value)
    return str(int(value))


@dataclass(frozen=True)
class Operands:
    """What a row sees: operand texts, their compute dtype (WHERE: the branches' dtype), the
    result's compute dtype, constant operand values (None where not a constant) and the mode."""

    args: Sequence[str]
    dtype: torch.dtype
    out: torch.dtype
    consts: Sequence[bool | int | float | None]
    interpret: bool

    @property
    def is_float(self) -> bool:
        return self.dtype.is_floating_point

    @property
    def is_bool(self) -> bool:
        return self.dtype == torch.bool


Spelling = Callable[[Operands], str]


def _fn(name: str) -> Spelling:
    return lambda o: f"{name}({', '.join(o.args)})"


def _by_mode(compiled: str, interpreted: str) -> Spelling:
    """A float function spelled ``libdevice.*`` on a GPU and ``_kiln_*`` under the interpreter."""
    return lambda o: f"{interpreted if o.interpret else compiled}({', '.join(o.args)})"


def _binary(symbol: str) -> Spelling:
    return lambda o: f"{o.args[0]} {symbol} {o.args[1]}"


def _per_kind(*, floats: Spelling, ints: Spelling, bools: Spelling | None = None) -> Spelling:
    def spell(o: Operands) -> str:
        if o.is_bool and bools is not None:
            return bools(o)
        return floats(o) if o.is_float else ints(o)

    return spell


def _identity(o: Operands) -> str:
    return o.args[0]


def _truthy(text: str, dtype: torch.dtype) -> str:
    return text if dtype == torch.bool else f"({text} != 0)"


def _logical(symbol: str) -> Spelling:
    return lambda o: f"{_truthy(o.args[0], o.dtype)} {symbol} {_truthy(o.args[1], o.dtype)}"


def _extremum(name: str, bool_symbol: str) -> Spelling:
    def spell(o: Operands) -> str:
        a, b = o.args
        if o.is_bool:
            return f"{a} {bool_symbol} {b}"
        if o.is_float:  # torch.maximum propagates NaN; tl.maximum does only when asked
            return f"tl.{name}({a}, {b}, propagate_nan=tl.PropagateNan.ALL)"
        return f"tl.{name}({a}, {b})"

    return spell


def _sqrt(o: Operands) -> str:  # sqrt_rn is IEEE (fp32 only); plain sqrt is approximate on fp32
    return f"tl.sqrt_rn({o.args[0]})" if o.dtype == torch.float32 else f"tl.sqrt({o.args[0]})"


def _sign(o: Operands) -> str:
    (a,) = o.args
    if o.is_bool:
        return a
    kind = tl_type(o.dtype)  # sign(NaN) = 0 like eager's (0 < a) - (a < 0)
    return f"({a} > 0).to({kind}) - ({a} < 0).to({kind})"


def _isinf(o: Operands) -> str:
    (a,) = o.args
    return f'tl.abs({a}) == float("inf")' if o.is_float else f"{a} != {a}"


def _bitwise_not(o: Operands) -> str:
    return f"{o.args[0]} == 0" if o.is_bool else f"~{o.args[0]}"


def _pow(o: Operands) -> str:
    a, b = o.args
    if not o.is_float:
        return f"_kiln_pow_int({a}, {b}, {INT_BITS[o.dtype] - 1})"
    exponent = o.consts[1]
    if exponent is not None and not isinstance(exponent, bool):
        # eager's pow_tensor_scalar special cases, so results match it bit for bit
        special = {
            1.0: a,
            2.0: f"{a} * {a}",
            3.0: f"{a} * {a} * {a}",
            0.5: _sqrt(Operands([a], o.dtype, o.out, [None], o.interpret)),
            -0.5: f"tl.rsqrt({a})",
            -1.0: f"1.0 / {a}",
            -2.0: f"1.0 / ({a} * {a})",
        }
        if float(exponent) in special:
            return special[float(exponent)]
    return f"{'_kiln_pow' if o.interpret else 'libdevice.pow'}({a}, {b})"


def _shift_left(o: Operands) -> str:
    a, b = o.args
    bits = INT_BITS[o.dtype]  # eager: 0 once the shift leaves the type
    return f"tl.where(({b} >= 0) & ({b} < {bits}), {a} << {b}, 0)"


def _shift_right(o: Operands) -> str:
    a, b = o.args
    bits = INT_BITS[o.dtype]  # eager: sign fill once the shift leaves the type
    return f"tl.where(({b} >= 0) & ({b} < {bits}), {a} >> {b}, {a} >> {bits - 1})"


def _float_or_int_helper(name: str) -> Spelling:
    return lambda o: f"_kiln_{name}{'' if o.is_float else '_int'}({', '.join(o.args)})"


def _fmod(o: Operands) -> str:
    return f"_kiln_fmod({o.args[0]}, {o.args[1]})" if o.is_float else _binary("%")(o)


SPELLINGS: dict[Op, Spelling] = {
    Op.NEG: lambda o: f"-{o.args[0]}",
    Op.ABS: _fn("tl.abs"),
    Op.EXP: _fn("tl.exp"),
    Op.EXP2: _fn("tl.exp2"),
    Op.EXPM1: _by_mode("libdevice.expm1", "_kiln_expm1"),
    Op.LOG: _fn("tl.log"),
    Op.LOG1P: _by_mode("libdevice.log1p", "_kiln_log1p"),
    Op.LOG2: _fn("tl.log2"),
    Op.SQRT: _sqrt,
    Op.RSQRT: _fn("tl.rsqrt"),
    Op.RECIPROCAL: lambda o: f"1.0 / {o.args[0]}",
    Op.SIN: _fn("tl.sin"),
    Op.COS: _fn("tl.cos"),
    Op.TAN: _by_mode("libdevice.tan", "_kiln_tan"),
    Op.TANH: _by_mode("libdevice.tanh", "_kiln_tanh"),
    Op.ASIN: _by_mode("libdevice.asin", "_kiln_asin"),
    Op.ACOS: _by_mode("libdevice.acos", "_kiln_acos"),
    Op.ATAN: _by_mode("libdevice.atan", "_kiln_atan"),
    Op.SINH: _by_mode("libdevice.sinh", "_kiln_sinh"),
    Op.COSH: _by_mode("libdevice.cosh", "_kiln_cosh"),
    Op.ERF: _fn("tl.erf"),
    Op.ERFINV: _by_mode("libdevice.erfinv", "_kiln_erfinv"),
    Op.SIGMOID: lambda o: f"1.0 / (1.0 + tl.exp(-{o.args[0]}))",
    Op.FLOOR: _per_kind(floats=_fn("tl.floor"), ints=_identity),
    Op.CEIL: _per_kind(floats=_fn("tl.ceil"), ints=_identity),
    Op.ROUND: _per_kind(floats=_by_mode("libdevice.rint", "_kiln_rint"), ints=_identity),
    Op.TRUNC: _per_kind(floats=_fn("_kiln_trunc"), ints=_identity),
    Op.SIGN: _sign,
    Op.ISNAN: lambda o: f"{o.args[0]} != {o.args[0]}",
    Op.ISINF: _isinf,
    Op.LOGICAL_NOT: lambda o: f"{o.args[0]} == 0",
    Op.BITWISE_NOT: _bitwise_not,
    Op.ADD: _per_kind(floats=_binary("+"), ints=_binary("+"), bools=_binary("|")),
    Op.SUB: _binary("-"),
    Op.MUL: _per_kind(floats=_binary("*"), ints=_binary("*"), bools=_binary("&")),
    Op.DIV: _binary("/"),
    Op.FLOOR_DIV: _float_or_int_helper("floor_div"),
    Op.REMAINDER: _float_or_int_helper("remainder"),
    Op.FMOD: _fmod,
    Op.POW: _pow,
    Op.MAXIMUM: _extremum("maximum", "|"),
    Op.MINIMUM: _extremum("minimum", "&"),
    Op.ATAN2: _by_mode("libdevice.atan2", "_kiln_atan2"),
    Op.EQ: _binary("=="),
    Op.NE: _binary("!="),
    Op.LT: _binary("<"),
    Op.LE: _binary("<="),
    Op.GT: _binary(">"),
    Op.GE: _binary(">="),
    Op.LOGICAL_AND: _logical("&"),
    Op.LOGICAL_OR: _logical("|"),
    Op.LOGICAL_XOR: _logical("^"),
    Op.BITWISE_AND: _binary("&"),
    Op.BITWISE_OR: _binary("|"),
    Op.BITWISE_XOR: _binary("^"),
    Op.SHIFT_LEFT: _shift_left,
    Op.SHIFT_RIGHT: _shift_right,
    Op.WHERE: _fn("tl.where"),
}


def convert(text: str, source: torch.dtype, target: torch.dtype, interpret: bool) -> str:
    """``text`` (a value of compute dtype ``source``) as a value of ``target``'s compute dtype,
    with ``target``'s rounding: to bf16/fp16 rounds and widens back to fp32; float -> int
    truncates toward zero; anything -> bool is ``!= 0``; bool -> number is 0/1."""
    if target == torch.bool:
        return text if source == torch.bool else f"({text} != 0)"
    if target in (torch.float16, torch.bfloat16):
        return f"{narrow(text, source, target, interpret)}.to(tl.float32)"
    return text if compute_dtype(target) == source else f"{text}.to({tl_type(target)})"


def narrow(text: str, source: torch.dtype, target: torch.dtype, interpret: bool) -> str:
    """``text`` (compute dtype ``source``) converted to the storage dtype ``target``."""
    if target == torch.bool:
        return text if source == torch.bool else f"({text} != 0)"
    if target not in (torch.float16, torch.bfloat16):
        return text if source == target else f"{text}.to({tl_type(target)})"
    if source != torch.float32:  # via fp32, as c10's Half/BFloat16 constructors do
        text = f"{text}.to(tl.float32)"
    if target == torch.bfloat16 and interpret:  # the interpreter truncates fp32 -> bf16
        text = f"_kiln_round_to_bf16({text})"
    return f"{text}.to({tl_type(target)})"


# ---------------------------------------------------------------------------------------------
# reductions over r (axis 1 of an [XBLOCK, RBLOCK] block; results are [XBLOCK, 1])

ARG_KINDS = frozenset({ReduceKind.ARGMAX, ReduceKind.ARGMIN})
_HIGH = frozenset({ReduceKind.MAX, ReduceKind.ARGMAX})


def reduce_identity(kind: ReduceKind, dtype: torch.dtype) -> str:
    """What masked-off lanes hold: the identity of the reduction in ``dtype``."""
    if kind is ReduceKind.SUM:
        return "0"
    if kind is ReduceKind.PROD:
        return "1"
    if dtype.is_floating_point:
        return 'float("-inf")' if kind in _HIGH else 'float("inf")'
    info = torch.iinfo(dtype)
    return str(info.min if kind in _HIGH else info.max)


def reduce_lanes(
    kind: ReduceKind, lanes: str, is_float: bool, interpret: bool, reshaped: bool = False
) -> str:
    """``lanes`` reduced along r: sum, product, or the NaN-propagating max/min (also the
    extreme an argmax/argmin looks for). ``tl.max`` ignores NaN on the GPU (maxnum) and in the
    interpreter (nanmax), so floats use a combine function with ``tl.maximum(...,
    propagate_nan=ALL)``; the interpreter runs combine functions per element in Python, so
    there a NaN count decides instead. ``reshaped``: the result made ``[XBLOCK, 1]`` by
    ``tl.reshape`` rather than ``[:, None]`` (see :func:`kept`)."""
    if kind is ReduceKind.SUM:
        return kept(f"tl.sum({lanes}, 1)", reshaped)
    if kind is ReduceKind.PROD:
        return kept(f"tl.reduce({lanes}, 1, _kiln_multiply)", reshaped)
    name = "max" if kind in _HIGH else "min"
    if not is_float:
        return kept(f"tl.{name}({lanes}, 1)", reshaped)
    if not interpret:
        return kept(f"tl.reduce({lanes}, 1, _kiln_{name}imum)", reshaped)
    nan = f"tl.max(({lanes} != {lanes}).to(tl.int8), 1)[:, None] > 0"
    return f'tl.where({nan}, float("nan"), tl.{name}({lanes}, 1)[:, None])'


def kept(reduced: str, reshaped: bool) -> str:
    """A row's reduced ``[XBLOCK]`` value as ``[XBLOCK, 1]``. Triton 3.6's layout pass
    (``TritonGPURemoveLayoutConversions``) failed on a BatchNorm backward's looped kernel with
    ``[:, None]`` and compiled it with ``tl.reshape``: the form a kernel is compiled in again
    when its first form fails (``kiln/backends/kernels.py``)."""
    return f"tl.reshape({reduced}, [XBLOCK, 1])" if reshaped else f"{reduced}[:, None]"


def first_index(
    kind: ReduceKind,
    lanes: str,
    extreme: str,
    indices: str,
    is_float: bool,
    valid: str | None,
    missing: object,
) -> str:
    """The smallest of ``indices`` where ``lanes`` holds ``extreme`` (or a NaN, which torch's
    argmax/argmin count as the extreme), as int64."""
    found = f"({lanes} == {extreme})" + (f" | ({lanes} != {lanes})" if is_float else "")
    if valid:
        found = f"({found}) & {valid}"
    return f"tl.min(tl.where({found}, {indices}, {missing}), 1)[:, None].to(tl.int64)"


def accumulate(kind: ReduceKind, acc: str, value: str, is_float: bool) -> str:
    """One loop step of a per-lane accumulator (not ARGMAX/ARGMIN)."""
    nan = ", propagate_nan=tl.PropagateNan.ALL" if is_float else ""
    return {
        ReduceKind.SUM: f"{acc} + {value}",
        ReduceKind.PROD: f"{acc} * {value}",
        ReduceKind.MAX: f"tl.maximum({acc}, {value}{nan})",
        ReduceKind.MIN: f"tl.minimum({acc}, {value}{nan})",
    }[kind]


def better_lane(
    kind: ReduceKind, value: str, acc: str, index: str, is_float: bool, missing: object
) -> str:
    """Whether a loop step's ``value`` replaces a lane's (value, index) pair in an
    argmax/argmin: strictly better (so each lane keeps its first extreme), the first NaN, or
    the lane's first element."""
    better = f"({value} {'>' if kind in _HIGH else '<'} {acc})"
    if is_float:
        better += f" | (({value} != {value}) & ({acc} == {acc}))"
    return f"{better} | ({index} == {missing})"


# ---------------------------------------------------------------------------------------------
# helpers: name -> (source, helpers it calls)

_HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_kiln_trunc": (
        """def _kiln_trunc(x):
    return tl.where(x < 0.0, tl.ceil(x), tl.floor(x))""",
        (),
    ),
    "_kiln_floor_div": (
        """def _kiln_floor_div(a, b):
    # eager's div_floor_floating: fmod first, so the quotient is exact
    mod = _kiln_fmod(a, b)
    div = (a - mod) / b
    div = tl.where((mod != 0.0) & ((b < 0.0) != (mod < 0.0)), div - 1.0, div)
    floor = tl.floor(div)
    floor = tl.where(div - floor > 0.5, floor + 1.0, floor)
    floor = tl.where(div == 0.0, tl.where(a / b < 0.0, -0.0, 0.0), floor)
    return tl.where(b == 0.0, a / b, floor)""",
        ("_kiln_fmod",),
    ),
    "_kiln_floor_div_int": (
        """def _kiln_floor_div_int(a, b):
    quotient = a // b  # truncates, like C
    rest = a % b
    return tl.where((rest != 0) & ((rest < 0) != (b < 0)), quotient - 1, quotient)""",
        (),
    ),
    "_kiln_remainder": (
        """def _kiln_remainder(a, b):
    mod = _kiln_fmod(a, b)
    return tl.where((mod != 0.0) & ((b < 0.0) != (mod < 0.0)), mod + b, mod)""",
        ("_kiln_fmod",),
    ),
    "_kiln_remainder_int": (
        """def _kiln_remainder_int(a, b):
    rest = a % b  # has the dividend's sign, like C
    return tl.where((rest != 0) & ((rest < 0) != (b < 0)), rest + b, rest)""",
        (),
    ),
    "_kiln_pow_int": (
        """def _kiln_pow_int(x, y, BITS: tl.constexpr):
    base = x + y * 0
    exponent = y + x * 0
    result = base * 0 + 1
    for _ in range(BITS):  # square and multiply; wraps like eager's repeated products
        result = tl.where((exponent & 1) != 0, result * base, result)
        base = base * base
        exponent = exponent >> 1
    # eager: a negative exponent gives 1 / x**-y in integer arithmetic
    sign = tl.where((y & 1) != 0, -1, 1)
    negative = tl.where(x == 1, 1, tl.where(x == -1, sign, 0))
    return tl.where(y < 0, negative, result)""",
        (),
    ),
    "_kiln_round_to_bf16": (
        """def _kiln_round_to_bf16(x):
    # round-to-nearest-even onto the bf16 grid (the interpreter's cast truncates)
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return tl.where(x != x, x, bits.to(tl.float32, bitcast=True))""",
        (),
    ),
}

# Interpreter-only compositions of tl primitives; the GPU spelling is libdevice.
_INTERPRETER_HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_kiln_fmod": (
        """def _kiln_fmod(a, b):
    return a % b  # exact (numpy fmod) in the interpreter""",
        (),
    ),
    "_kiln_expm1": (
        """def _kiln_expm1(x):
    # Kahan: (u - 1) * x / log(u) cancels the rounding error of u = exp(x)
    u = tl.exp(x)
    um1 = u - 1.0
    y = tl.where(um1 == 0.0, x, um1 * (x / tl.log(u)))
    y = tl.where(um1 == -1.0, -1.0, y)
    return tl.where(u == float("inf"), u, y)""",
        (),
    ),
    "_kiln_log1p": (
        """def _kiln_log1p(x):
    # Kahan: log(u) * x / (u - 1) cancels the rounding error of u = 1 + x
    u = 1.0 + x
    d = u - 1.0
    y = tl.where(d == 0.0, x, tl.log(u) * (x / d))
    return tl.where(u == float("inf"), u, y)""",
        (),
    ),
    "_kiln_tan": (
        """def _kiln_tan(x):
    return tl.sin(x) / tl.cos(x)""",
        (),
    ),
    "_kiln_tanh": (
        """def _kiln_tanh(x):
    a = tl.abs(x)
    t = _kiln_expm1(2.0 * a)
    y = tl.where(a > 20.0, 1.0, t / (t + 2.0))
    return tl.where(x < 0.0, -y, y)""",
        ("_kiln_expm1",),
    ),
    "_kiln_sinh": (
        """def _kiln_sinh(x):
    a = tl.abs(x)
    e = _kiln_expm1(a)
    y = 0.5 * (e + e / (e + 1.0))
    y = tl.where(a > 80.0, tl.exp(a - 0.6931471805599453), y)
    return tl.where(x < 0.0, -y, y)""",
        ("_kiln_expm1",),
    ),
    "_kiln_cosh": (
        """def _kiln_cosh(x):
    a = tl.abs(x)
    e = tl.exp(a)
    return tl.where(a > 80.0, tl.exp(a - 0.6931471805599453), 0.5 * (e + 1.0 / e))""",
        (),
    ),
    "_kiln_atan": (
        """def _kiln_atan(x):
    # Cephes atanf: reduce to |z| <= tan(pi/8), then a degree-9 odd polynomial
    a = tl.abs(x)
    big = a > 2.414213562373095
    mid = a > 0.41421356237309503
    z = tl.where(big, -1.0 / a, tl.where(mid, (a - 1.0) / (a + 1.0), a))
    y0 = tl.where(big, 1.5707963267948966, tl.where(mid, 0.7853981633974483, 0.0))
    z2 = z * z
    p = 8.05374449538e-2 * z2 - 1.38776856032e-1
    p = p * z2 + 1.99777106478e-1
    p = p * z2 - 3.33329491539e-1
    r = y0 + (p * z2 * z + z)
    return tl.where(x < 0.0, -r, r)""",
        (),
    ),
    "_kiln_atan2": (
        """def _kiln_atan2(y, x):
    ax = tl.abs(x)
    ay = tl.abs(y)
    high = tl.maximum(ax, ay, propagate_nan=tl.PropagateNan.ALL)
    low = tl.minimum(ax, ay, propagate_nan=tl.PropagateNan.ALL)
    r = _kiln_atan(tl.where(high == low, 1.0, low / high))  # inf/inf: pi/4
    r = tl.where(ay > ax, 1.5707963267948966 - r, r)
    r = tl.where(high == 0.0, 0.0, r)
    r = tl.where(x < 0.0, 3.141592653589793 - r, r)
    return tl.where(y < 0.0, -r, r)""",
        ("_kiln_atan",),
    ),
    "_kiln_asin": (
        """def _kiln_asin(x):
    return _kiln_atan2(x, tl.sqrt((1.0 - x) * (1.0 + x)))""",
        ("_kiln_atan2",),
    ),
    "_kiln_acos": (
        """def _kiln_acos(x):
    return _kiln_atan2(tl.sqrt((1.0 - x) * (1.0 + x)), x)""",
        ("_kiln_atan2",),
    ),
    "_kiln_erfinv": (
        """def _kiln_erfinv(x):
    # Giles (2010), single precision, then one Newton step on erf(r) = x
    w = -tl.log((1.0 - x) * (1.0 + x))
    c = w - 2.5
    p = 2.81022636e-08 * c + 3.43273939e-07
    p = p * c - 3.5233877e-06
    p = p * c - 4.39150654e-06
    p = p * c + 0.00021858087
    p = p * c - 0.00125372503
    p = p * c - 0.00417768164
    p = p * c + 0.246640727
    p = p * c + 1.50140941
    t = tl.sqrt(w) - 3.0
    q = -0.000200214257 * t + 0.000100950558
    q = q * t + 0.00134934322
    q = q * t - 0.00367342844
    q = q * t + 0.00573950773
    q = q * t - 0.0076224613
    q = q * t + 0.00943887047
    q = q * t + 1.00167406
    q = q * t + 2.83297682
    r = tl.where(w < 5.0, p, q) * x
    step = (tl.erf(r) - x) / (1.1283791670955126 * tl.exp(-r * r))
    r = tl.where(w < 6.25, r - step, r)
    return tl.where(tl.abs(x) == 1.0, x * float("inf"), r)""",
        (),
    ),
    "_kiln_rint": (
        """def _kiln_rint(x):
    # round half to even
    floor = tl.floor(x)
    rest = x - floor
    odd = floor - 2.0 * tl.floor(0.5 * floor) != 0.0
    return tl.where((rest > 0.5) | ((rest == 0.5) & odd), floor + 1.0, floor)""",
        (),
    ),
    "_kiln_pow": (
        """def _kiln_pow(x, y):
    # C pow through exp2(y * log2|x|), with the sign and special cases C defines
    ax = tl.abs(x)
    r = tl.exp2(y * tl.log2(ax))
    whole = tl.floor(y) == y
    odd = whole & (y - 2.0 * tl.floor(0.5 * y) == 1.0)
    negative = (x < 0.0) | ((x == 0.0) & (1.0 / x < 0.0))  # -0.0 too
    r = tl.where(negative & odd, -r, r)
    r = tl.where((x < 0.0) & (whole == 0), float("nan"), r)
    one = (y == 0.0) | (x == 1.0) | ((ax == 1.0) & (tl.abs(y) == float("inf")))
    return tl.where(one, 1.0, r)""",
        (),
    ),
}

_COMPILED_HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_kiln_fmod": (
        """def _kiln_fmod(a, b):
    return libdevice.fmod(a, b)  # frem lowers to an inexact a - trunc(a / b) * b""",
        (),
    ),
}

# Reductions: combine functions for tl.reduce (NaN-propagating max/min, product).
_COMBINE_HELPERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "_kiln_maximum": (
        """def _kiln_maximum(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)""",
        (),
    ),
    "_kiln_minimum": (
        """def _kiln_minimum(a, b):
    return tl.minimum(a, b, propagate_nan=tl.PropagateNan.ALL)""",
        (),
    ),
    "_kiln_multiply": (
        """def _kiln_multiply(a, b):
    return a * b""",
        (),
    ),
}


def _helper(name: str, interpret: bool) -> tuple[str, tuple[str, ...]]:
    mode_table = _INTERPRETER_HELPERS if interpret else _COMPILED_HELPERS
    for table in (mode_table, _HELPERS, _COMBINE_HELPERS):
        if name in table:
            return table[name]
    raise KeyError(f"no Triton helper {name} ({'interpreter' if interpret else 'compiled'})")


def helper_names() -> frozenset[str]:
    tables = (_HELPERS, _INTERPRETER_HELPERS, _COMPILED_HELPERS, _COMBINE_HELPERS)
    return frozenset(name for table in tables for name in table)


def helper_sources(used: set[str], interpret: bool) -> list[str]:
    """The ``@triton.jit`` definitions of the helpers ``used`` calls, callees first."""
    ordered: list[str] = []

    def visit(name: str) -> None:
        if name in ordered:
            return
        _, deps = _helper(name, interpret)
        for dep in deps:
            visit(dep)
        ordered.append(name)

    for name in sorted(used):
        visit(name)
    return [f"@triton.jit\n{_helper(name, interpret)[0]}" for name in ordered]
