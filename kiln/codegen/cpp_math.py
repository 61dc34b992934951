"""The C++ spelling of Kiln's scalar math: types, literals, conversions and elementwise ops
(:data:`SPELLINGS`, one row per op).

Values are computed in a *compute type*: float16 and bfloat16 are stored as ``uint16_t`` bits
and computed in ``float``, converted at loads and stores with bit operations that vectorize
(g++ 12 has ``_Float16``, but vectorizes its conversions only with AVX512-FP16); bools are 0/1
bytes; every other dtype is computed in its own C type. :data:`PRELUDE` opens every generated
translation unit: libmvec declarations (so ``expf`` and friends vectorize without
``-ffast-math``), the 16-bit conversions, integer ops with PyTorch's semantics (wrapping
arithmetic, Python floor division, shifts), ``erfinv`` and Triton's Philox-4x32-10 generator.

    spell(Op.MAXIMUM, ["t1", "t2"], torch.float32)    # 'kiln_maximum(t1, t2)'
    convert("t3", torch.float32, torch.bfloat16)      # 'kiln_round_bf16((float)(t3))'
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from kiln.ir.op import Op

STORAGE_TYPES: dict[torch.dtype, str] = {
    torch.float32: "float",
    torch.float64: "double",
    torch.float16: "uint16_t",
    torch.bfloat16: "uint16_t",
    torch.int8: "int8_t",
    torch.uint8: "uint8_t",
    torch.int16: "int16_t",
    torch.int32: "int32_t",
    torch.int64: "int64_t",
    torch.bool: "uint8_t",  # as torch stores it; a C++ bool load does not vectorize in g++
}
HALF_TYPES = frozenset({torch.float16, torch.bfloat16})


def storage_type(dtype: torch.dtype) -> str:
    try:
        return STORAGE_TYPES[dtype]
    except KeyError:
        raise NotImplementedError(f"the C++ code generator does not handle {dtype}") from None


def compute_type(dtype: torch.dtype) -> str:
    """The C type a value is computed in: ``float`` for 16-bit floats; bools are 0/1 bytes
    (g++ vectorizes no conversion from a C++ ``bool``)."""
    return "float" if dtype in HALF_TYPES else storage_type(dtype)


def literal(value: bool | int | float, dtype: torch.dtype) -> str:
    """``value`` as a C literal of ``dtype``'s compute type (16-bit floats rounded first, as a
    Python scalar is rounded to the tensor's dtype)."""
    if dtype == torch.bool:
        return "true" if value else "false"
    if dtype.is_floating_point:
        number = float(value)
        if dtype in HALF_TYPES:
            number = float(torch.tensor(number, dtype=dtype).float().item())
        single = dtype != torch.float64
        if math.isnan(number):
            return "NAN" if single else "(double)NAN"
        if math.isinf(number):
            text = "INFINITY" if number > 0 else "-INFINITY"
            return text if single else f"(double){text}"
        if not single:
            return repr(number)
        exact = float(torch.tensor(number, dtype=torch.float32).item()) == number
        return f"{number!r}f" if exact else f"(float){number!r}"
    number = int(value)
    if dtype == torch.int64:
        return "INT64_MIN" if number == -(2**63) else f"INT64_C({number})"
    if dtype == torch.int32 and number == -(2**31):
        return "INT32_MIN"
    return str(number) if dtype == torch.int32 else f"({storage_type(dtype)}){number}"


def convert(text: str, source: torch.dtype, target: torch.dtype) -> str:
    """PyTorch's ``.to(target)`` of a compute-type value: float -> int truncates, anything ->
    bool is ``!= 0``, and a conversion to a 16-bit float rounds to it (the value stays a
    ``float``)."""
    if source == target:
        return text
    if target == torch.bool:
        return f"({text} != 0)"
    if target in HALF_TYPES:
        helper = "kiln_round_bf16" if target == torch.bfloat16 else "kiln_round_half"
        return f"{helper}((float)({text}))"
    if source in HALF_TYPES and target == torch.float32:
        return text
    if source.is_floating_point and target in {torch.int8, torch.uint8, torch.int16}:
        return f"({storage_type(target)})(int64_t)({text})"  # eager wraps through int64
    return f"({compute_type(target)})({text})"


# The half types are stored as 16-bit patterns and computed in float (the prelude's helpers).
_LOADS = {torch.bfloat16: "kiln_bf16_to_float", torch.float16: "kiln_half_to_float"}
_STORES = {torch.bfloat16: "kiln_float_to_bf16", torch.float16: "kiln_float_to_half"}


def load(text: str, dtype: torch.dtype) -> str:
    """A stored element read into its compute type."""
    return f"{_LOADS[dtype]}({text})" if dtype in _LOADS else text


def store(text: str, dtype: torch.dtype) -> str:
    """A compute-type value as it is stored."""
    return f"{_STORES[dtype]}({text})" if dtype in _STORES else text


# ---------------------------------------------------------------------------------------------
# elementwise ops: SPELLINGS has one row per op. A spelling takes the argument texts and the
# operands' dtype (a comparison's operands, WHERE's values) and gives the C++ expression, or
# None where the op has no meaning for that dtype. The functions and templates the rows call
# (kiln_wrap_add, kiln_erfinv, ...) are defined in the prelude below.

Spelling = Callable[[list[str], torch.dtype], str | None]


def _suffix(dtype: torch.dtype) -> str:
    """libm's name suffix: ``exp`` is the double version, ``expf`` the float one."""
    return "" if dtype == torch.float64 else "f"


def _one(dtype: torch.dtype) -> str:
    return "1.0" if dtype == torch.float64 else "1.0f"


def _per_kind(
    *, floats: Spelling | None = None, ints: Spelling | None = None, bools: Spelling | None = None
) -> Spelling:
    """One spelling per kind of dtype; a kind left out has no such op."""

    def spell(args: list[str], dtype: torch.dtype) -> str | None:
        chosen = floats if dtype.is_floating_point else bools if dtype == torch.bool else ints
        return None if chosen is None else chosen(args, dtype)

    return spell


def _libm(name: str) -> Spelling:
    """A libm function of floats, ``name`` being its double version."""
    return lambda args, dtype: f"{name}{_suffix(dtype)}({', '.join(args)})"


def _float_libm(name: str) -> Spelling:
    """A libm function, defined on floats only."""
    return _per_kind(floats=_libm(name))


def _call(name: str) -> Spelling:
    return lambda args, dtype: f"{name}({', '.join(args)})"


def _infix(symbol: str) -> Spelling:
    return lambda args, dtype: f"({args[0]} {symbol} {args[1]})"


def _narrowed(symbol: str) -> Spelling:
    """An integer operator cast back to its type, undoing C++'s promotion to int."""
    return lambda args, dtype: f"({storage_type(dtype)})({args[0]} {symbol} {args[1]})"


def _select(symbol: str) -> Spelling:
    return lambda args, dtype: f"({args[0]} {symbol} {args[1]} ? {args[0]} : {args[1]})"


def _logical(symbol: str) -> Spelling:
    return lambda args, dtype: f"(({args[0]} != 0) {symbol} ({args[1]} != 0))"


def _text(text: str) -> Spelling:
    return lambda args, dtype: text


def _same(args: list[str], dtype: torch.dtype) -> str:
    return args[0]


def _sign(args: list[str], dtype: torch.dtype) -> str:
    (a,) = args
    return f"({compute_type(dtype)})((0 < {a}) - ({a} < 0))"


def _sigmoid(args: list[str], dtype: torch.dtype) -> str:
    one = _one(dtype)
    return f"({one} / ({one} + exp{_suffix(dtype)}(-{args[0]})))"


_FALSE = _text("false")  # isnan/isinf of an integer or bool

SPELLINGS: dict[Op, Spelling] = {
    Op.NEG: _per_kind(floats=lambda a, d: f"(-{a[0]})", ints=_call("kiln_wrap_neg")),
    Op.ABS: _per_kind(floats=_libm("fabs"), ints=_call("kiln_wrap_abs"), bools=_same),
    Op.EXP: _float_libm("exp"),
    Op.EXP2: _float_libm("exp2"),
    Op.EXPM1: _float_libm("expm1"),
    Op.LOG: _float_libm("log"),
    Op.LOG1P: _float_libm("log1p"),
    Op.LOG2: _float_libm("log2"),
    Op.SQRT: _float_libm("sqrt"),
    Op.RSQRT: _per_kind(floats=lambda a, d: f"({_one(d)} / sqrt{_suffix(d)}({a[0]}))"),
    Op.RECIPROCAL: _per_kind(floats=lambda a, d: f"({_one(d)} / {a[0]})"),
    Op.SIN: _float_libm("sin"),
    Op.COS: _float_libm("cos"),
    Op.TAN: _float_libm("tan"),
    Op.TANH: _float_libm("tanh"),
    Op.ASIN: _float_libm("asin"),
    Op.ACOS: _float_libm("acos"),
    Op.ATAN: _float_libm("atan"),
    Op.SINH: _float_libm("sinh"),
    Op.COSH: _float_libm("cosh"),
    Op.ERF: _float_libm("erf"),
    Op.ERFINV: _per_kind(floats=_call("kiln_erfinv")),
    Op.SIGMOID: _per_kind(floats=_sigmoid),
    Op.FLOOR: _per_kind(floats=_libm("floor"), ints=_same),
    Op.CEIL: _per_kind(floats=_libm("ceil"), ints=_same),
    # rint: half to even in the default rounding mode, like torch.round
    Op.ROUND: _per_kind(floats=_libm("rint"), ints=_same),
    Op.TRUNC: _per_kind(floats=_libm("trunc"), ints=_same),
    Op.SIGN: _per_kind(floats=_sign, ints=_sign, bools=_same),
    Op.ISNAN: _per_kind(floats=lambda a, d: f"({a[0]} != {a[0]})", ints=_FALSE, bools=_FALSE),
    Op.ISINF: _per_kind(
        floats=lambda a, d: f"(fabs{_suffix(d)}({a[0]}) == INFINITY)", ints=_FALSE, bools=_FALSE
    ),
    Op.LOGICAL_NOT: lambda a, d: f"({a[0]} == 0)",
    Op.BITWISE_NOT: _per_kind(
        ints=lambda a, d: f"({storage_type(d)})(~{a[0]})", bools=lambda a, d: f"(!{a[0]})"
    ),
    # bools: bitwise, not short-circuit operators: branch-free, so the loop vectorizes
    Op.ADD: _per_kind(floats=_infix("+"), ints=_call("kiln_wrap_add"), bools=_infix("|")),
    Op.SUB: _per_kind(floats=_infix("-"), ints=_call("kiln_wrap_sub")),
    Op.MUL: _per_kind(floats=_infix("*"), ints=_call("kiln_wrap_mul"), bools=_infix("&")),
    Op.DIV: _per_kind(floats=_infix("/")),
    Op.FLOOR_DIV: _per_kind(floats=_call("kiln_floordiv_float"), ints=_call("kiln_floordiv_int")),
    Op.REMAINDER: _per_kind(floats=_call("kiln_remainder_float"), ints=_call("kiln_remainder_int")),
    Op.FMOD: _per_kind(floats=_libm("fmod"), ints=_call("kiln_fmod_int")),
    Op.POW: _per_kind(floats=_libm("pow"), ints=_call("kiln_pow_int")),
    Op.MAXIMUM: _per_kind(floats=_call("kiln_maximum"), ints=_select(">"), bools=_infix("|")),
    Op.MINIMUM: _per_kind(floats=_call("kiln_minimum"), ints=_select("<"), bools=_infix("&")),
    Op.ATAN2: _float_libm("atan2"),
    Op.EQ: _infix("=="),
    Op.NE: _infix("!="),
    Op.LT: _infix("<"),
    Op.LE: _infix("<="),
    Op.GT: _infix(">"),
    Op.GE: _infix(">="),
    Op.LOGICAL_AND: _logical("&"),
    Op.LOGICAL_OR: _logical("|"),
    Op.LOGICAL_XOR: _logical("!="),
    Op.BITWISE_AND: _per_kind(ints=_narrowed("&"), bools=_infix("&")),
    Op.BITWISE_OR: _per_kind(ints=_narrowed("|"), bools=_infix("|")),
    Op.BITWISE_XOR: _per_kind(ints=_narrowed("^"), bools=_infix("!=")),
    Op.SHIFT_LEFT: _per_kind(ints=_call("kiln_shift_left")),
    Op.SHIFT_RIGHT: _per_kind(ints=_call("kiln_shift_right")),
    Op.WHERE: lambda a, d: f"({a[0]} ? {a[1]} : {a[2]})",
}


def spell(op: Op, args: list[str], dtype: torch.dtype) -> str:
    """The C++ expression of elementwise ``op`` on compute-type ``args`` whose dtype is
    ``dtype`` (WHERE: the values' dtype; CONVERT is :func:`convert`)."""
    spelling = SPELLINGS.get(op)
    text = None if spelling is None else spelling(args, dtype)
    if text is None:
        raise NotImplementedError(f"the C++ code generator has no {op.printed_name} for {dtype}")
    return text


# glibc's libmvec has vector versions of these (x86-64; the second group since glibc 2.35).
_SIMD_UNARY_OLD = ("exp", "log", "sin", "cos")
_SIMD_UNARY_NEW = (
    "exp2",
    "expm1",
    "log1p",
    "log2",
    "tan",
    "tanh",
    "asin",
    "acos",
    "atan",
    "sinh",
    "cosh",
    "erf",
)


def _simd_declarations() -> str:
    def unary(name: str) -> str:
        return f"KILN_SIMD_UNARY({name})"

    old = " ".join(unary(n) for n in _SIMD_UNARY_OLD)
    new = " ".join(unary(n) for n in _SIMD_UNARY_NEW)
    return f"""\
#if defined(KILN_SIMD_MATH) && defined(__x86_64__) && defined(__GLIBC__)
// Declared SIMD-callable so loops vectorize into glibc's libmvec without -ffast-math.
#define KILN_SIMD __attribute__((simd("notinbranch")))
#define KILN_SIMD_UNARY(name) \\
  extern "C" KILN_SIMD float name##f(float) noexcept; \\
  extern "C" KILN_SIMD double name(double) noexcept;
{old}
extern "C" KILN_SIMD float powf(float, float) noexcept;
extern "C" KILN_SIMD double pow(double, double) noexcept;
#if __GLIBC_PREREQ(2, 35)
{new}
extern "C" KILN_SIMD float atan2f(float, float) noexcept;
extern "C" KILN_SIMD double atan2(double, double) noexcept;
#endif
#endif
"""


_HELPERS = r"""
static inline float kiln_bits_to_float(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t kiln_float_to_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

// bfloat16: the high half of a float; stores round to nearest even, NaN -> 0x7FC0 (as c10).
static inline float kiln_bf16_to_float(uint16_t h) { return kiln_bits_to_float((uint32_t)h << 16); }
static inline uint16_t kiln_float_to_bf16(float f) {
  const uint32_t u = kiln_float_to_bits(f);
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return (uint16_t)(f != f ? 0x7FC0u : rounded);
}
static inline float kiln_round_bf16(float f) { return kiln_bf16_to_float(kiln_float_to_bf16(f)); }

// IEEE half by float arithmetic (exact: scaling by powers of two, one rounding add).
static inline float kiln_half_to_float(uint16_t h) {
  const uint32_t w = (uint32_t)h << 16;
  const uint32_t sign = w & 0x80000000u;
  const uint32_t two_w = w + w;
  const float normal = kiln_bits_to_float((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
  const float subnormal = kiln_bits_to_float((two_w >> 17) | (126u << 23)) - 0.5f;
  const uint32_t magnitude =
      two_w < (1u << 27) ? kiln_float_to_bits(subnormal) : kiln_float_to_bits(normal);
  return kiln_bits_to_float(sign | magnitude);
}
static inline uint16_t kiln_float_to_half(float f) {
  float base = (fabsf(f) * 0x1.0p+112f) * 0x1.0p-110f;  // overflow to inf, keep the rest
  const uint32_t w = kiln_float_to_bits(f);
  const uint32_t shl1_w = w + w;
  const uint32_t sign = w & 0x80000000u;
  uint32_t bias = shl1_w & 0xFF000000u;
  bias = bias < 0x71000000u ? 0x71000000u : bias;
  base = kiln_bits_to_float((bias >> 1) + 0x07800000u) + base;  // the rounding add
  const uint32_t bits = kiln_float_to_bits(base);
  const uint32_t nonsign = ((bits >> 13) & 0x7C00u) + (bits & 0x0FFFu);
  return (uint16_t)((sign >> 16) | (shl1_w > 0xFF000000u ? 0x7E00u : nonsign));
}
static inline float kiln_round_half(float f) { return kiln_half_to_float(kiln_float_to_half(f)); }

// Integers wrap like PyTorch's (two's complement), computed unsigned to stay defined in C++.
template <typename T> using kiln_unsigned =
    typename std::conditional<sizeof(T) == 8, uint64_t, uint32_t>::type;
template <typename T> static inline T kiln_wrap_add(T a, T b) {
  return (T)((kiln_unsigned<T>)a + (kiln_unsigned<T>)b);
}
template <typename T> static inline T kiln_wrap_sub(T a, T b) {
  return (T)((kiln_unsigned<T>)a - (kiln_unsigned<T>)b);
}
template <typename T> static inline T kiln_wrap_mul(T a, T b) {
  return (T)((kiln_unsigned<T>)a * (kiln_unsigned<T>)b);
}
template <typename T> static inline T kiln_wrap_neg(T a) { return (T)(0 - (kiln_unsigned<T>)a); }
template <typename T> static inline T kiln_wrap_abs(T a) { return a < 0 ? kiln_wrap_neg(a) : a; }

// Python's floor division and modulo; by 0 (undefined in torch too) they give 0, not SIGFPE.
template <typename T> static inline T kiln_floordiv_int(T a, T b) {
  if (b == 0) return 0;
  if (b == (T)-1) return kiln_wrap_neg(a);
  const T q = (T)(a / b), r = (T)(a % b);
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(q - 1) : q;
}
template <typename T> static inline T kiln_remainder_int(T a, T b) {
  if (b == 0 || b == (T)-1) return 0;
  const T r = (T)(a % b);
  return (r != 0 && ((r < 0) != (b < 0))) ? (T)(r + b) : r;
}
template <typename T> static inline T kiln_fmod_int(T a, T b) {
  return (b == 0 || b == (T)-1) ? (T)0 : (T)(a % b);
}
template <typename T> static inline T kiln_pow_int(T a, T b) {
  if (b < 0) return a == 1 ? (T)1 : a == (T)-1 ? (T)((b % 2) ? -1 : 1) : (T)0;
  kiln_unsigned<T> result = 1, base = (kiln_unsigned<T>)a;
  while (b) {
    if (b & 1) result *= base;
    b = (T)(b / 2);
    base *= base;
  }
  return (T)result;
}
template <typename T> static inline T kiln_shift_left(T a, T b) {
  typedef typename std::make_signed<T>::type S;
  if ((S)b < 0 || b >= (T)(sizeof(T) * 8)) return 0;
  return (T)((typename std::make_unsigned<T>::type)a << b);
}
template <typename T> static inline T kiln_shift_right(T a, T b) {
  typedef typename std::make_signed<T>::type S;
  const T max_shift = (T)(sizeof(T) * 8 - std::is_signed<T>::value);
  if ((S)b < 0 || b >= max_shift) return (T)(a >> max_shift);
  return (T)(a >> b);
}

// Floats: NaN-propagating extrema and Python's floor division / modulo (as eager's kernels).
template <typename T> static inline T kiln_maximum(T a, T b) { return (a != a || a > b) ? a : b; }
template <typename T> static inline T kiln_minimum(T a, T b) { return (a != a || a < b) ? a : b; }
template <typename T> static inline T kiln_floordiv_float(T a, T b) {
  if (b == 0) return a / b;
  const T mod = fmod(a, b);
  T div = (a - mod) / b;
  if (mod != 0 && ((b < 0) != (mod < 0))) div -= 1;
  if (div == 0) return copysign((T)0, a / b);
  T result = floor(div);
  if (div - result > (T)0.5) result += 1;
  return result;
}
template <typename T> static inline T kiln_remainder_float(T a, T b) {
  T mod = fmod(a, b);
  if (mod != 0 && ((b < 0) != (mod < 0))) mod += b;
  return mod;
}

// erfinv: a rational first guess (central range |y| <= 0.7, else a tail in sqrt(-log)),
// then two Newton steps on erf(x) - y, which bring it to the type's accuracy.
#define KILN_ERFINV(T, S, ONE)                                                         \
  static inline T kiln_erfinv(T y) {                                                   \
    const T a = fabs##S(y), z = y * y;                                                 \
    const T central_num = (((T)-0.140543331 * z + (T)0.914624893) * z                  \
        + (T)-1.645349621) * z + (T)0.886226899;                                       \
    const T central_den = ((((T)0.012229801 * z + (T)-0.329097515) * z                 \
        + (T)1.442710462) * z + (T)-2.118377725) * z + ONE;                            \
    const T w = sqrt##S(-log##S((ONE - a) / (T)2.0));                                  \
    const T tail_num = (((T)1.641345311 * w + (T)3.429567803) * w                      \
        + (T)-1.624906493) * w + (T)-1.970840454;                                      \
    const T tail_den = ((T)1.637067800 * w + (T)3.543889200) * w + ONE;                \
    T x = a <= (T)0.7 ? y * central_num / central_den                                  \
                      : copysign##S(tail_num, y) / tail_den;                           \
    const T slope = (T)2.0 / (T)1.7724538509055159;                                    \
    x = x - (erf##S(x) - y) / (slope * exp##S(-x * x));                                \
    x = x - (erf##S(x) - y) / (slope * exp##S(-x * x));                                \
    x = a == ONE ? copysign##S((T)INFINITY, y) : x;                                    \
    return a > ONE ? (T)NAN : x;                                                       \
  }
KILN_ERFINV(double, , 1.0)
// float: the same algorithm in double, rounded once. In float, erf(x) - y cancels near +-1
// (libmvec's vector erff is a few ulp off there), which the Newton steps cannot undo.
static inline float kiln_erfinv(float y) { return (float)kiln_erfinv((double)y); }

// Philox-4x32-10 as Triton's tl.rand/tl.randn: key = the seed's halves, counter = (offset,
// 0, 0, 0); a uniform float from the first word, a normal by Box-Muller from the first two.
struct kiln_words { uint32_t c0, c1; };
static inline uint32_t kiln_mulhi(uint32_t a, uint32_t b) {
  return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
}
static inline kiln_words kiln_philox(uint32_t offset, uint32_t k0, uint32_t k1) {
  uint32_t c0 = offset, c1 = 0, c2 = 0, c3 = 0;
  for (int round = 0; round < 10; ++round) {
    const uint32_t p0 = c0, p2 = c2;
    c0 = kiln_mulhi(0xCD9E8D57u, p2) ^ c1 ^ k0;
    c2 = kiln_mulhi(0xD2511F53u, p0) ^ c3 ^ k1;
    c1 = 0xCD9E8D57u * p2;
    c3 = 0xD2511F53u * p0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  kiln_words words = {c0, c1};
  return words;
}
static inline float kiln_uniform(uint32_t word) {
  const int32_t x = (int32_t)word;
  return (float)(x < 0 ? ~x : x) * 4.6566127342e-10f;
}
static inline float kiln_rand(uint32_t offset, uint32_t k0, uint32_t k1) {
  return kiln_uniform(kiln_philox(offset, k0, k1).c0);
}
static inline float kiln_randn(uint32_t offset, uint32_t k0, uint32_t k1) {
  const kiln_words words = kiln_philox(offset, k0, k1);
  float u1 = kiln_uniform(words.c0);
  u1 = u1 < 1.0e-7f ? 1.0e-7f : u1;
  const float theta = 6.283185307179586f * kiln_uniform(words.c1);
  return sqrtf(-2.0f * logf(u1)) * cosf(theta);
}
"""

# Gathered indices (kiln.schedule.index.Indirect, checked) outside their dimension read
# element 0 instead and are recorded (flag, index, size) for the launcher to raise IndexError.
_INDEX_CHECK = """
extern "C" { int64_t kiln_index_error[3] = {0, 0, 0}; }
static inline int64_t kiln_checked_index(int64_t i, int64_t size, int wrapped) {
  if (__builtin_expect(i >= 0 && i < size, 1)) return i;
  if (!__atomic_exchange_n(&kiln_index_error[0], 1, __ATOMIC_RELAXED)) {
    kiln_index_error[1] = wrapped && i < 0 ? i - size : i;  // (wrapped: size was added)
    kiln_index_error[2] = size;
  }
  return 0;
}
"""

# Division of a non-negative int32 index by a size known only at run time: a multiply and a
# shift (Granlund and Montgomery: with k = 31 + ceil(log2 d) and m = ceil(2**k / d) < 2**32,
# floor(x / d) == (x * m) >> k for every 0 <= x < 2**31), which GCC vectorizes; '/' it does not.
_RUNTIME_DIVISION = """
struct kiln_divisor { uint64_t magic; int shift; };
static inline kiln_divisor kiln_divisor_of(int64_t d) {
  int l = 0;
  while ((int64_t(1) << l) < d) ++l;
  const int k = 31 + l;
  const unsigned __int128 top = ((unsigned __int128)1) << k;
  return {(uint64_t)((top + (unsigned __int128)(d - 1)) / (unsigned __int128)d), k};
}
static inline int32_t kiln_div(int32_t x, kiln_divisor d) {
  return (int32_t)(((uint64_t)(uint32_t)x * d.magic) >> d.shift);
}
"""

PRELUDE = (
    """\
// Generated by Kiln (kiln/codegen/cpp.py) from the loop-level IR; do not edit.
#include <math.h>
#include <stdint.h>
#include <string.h>
#include <type_traits>
"""
    + _simd_declarations()
    + _HELPERS
    + _INDEX_CHECK
    + _RUNTIME_DIVISION
)
