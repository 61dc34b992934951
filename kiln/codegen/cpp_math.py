"""The C++ spelling of Kiln's scalar math: types, literals, conversions and elementwise ops.

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


def load(text: str, dtype: torch.dtype) -> str:
    """A stored element read into its compute type."""
    if dtype == torch.bfloat16:
        return f"kiln_bf16_to_float({text})"
    if dtype == torch.float16:
        return f"kiln_half_to_float({text})"
    return text


def store(text: str, dtype: torch.dtype) -> str:
    """A compute-type value as it is stored."""
    if dtype == torch.bfloat16:
        return f"kiln_float_to_bf16({text})"
    if dtype == torch.float16:
        return f"kiln_float_to_half({text})"
    return text


# ---------------------------------------------------------------------------------------------
# elementwise ops. A spelling takes the argument texts and the operands' dtype (a comparison's
# operands, WHERE's values); Python tables keep one op's C++ text in one place.

Spelling = Callable[[list[str], torch.dtype], str]

# libm functions of floats: name of the double version (float adds "f").
_LIBM_UNARY = {
    Op.EXP: "exp",
    Op.EXP2: "exp2",
    Op.EXPM1: "expm1",
    Op.LOG: "log",
    Op.LOG1P: "log1p",
    Op.LOG2: "log2",
    Op.SQRT: "sqrt",
    Op.SIN: "sin",
    Op.COS: "cos",
    Op.TAN: "tan",
    Op.TANH: "tanh",
    Op.ASIN: "asin",
    Op.ACOS: "acos",
    Op.ATAN: "atan",
    Op.SINH: "sinh",
    Op.COSH: "cosh",
    Op.ERF: "erf",
    Op.FLOOR: "floor",
    Op.CEIL: "ceil",
    Op.TRUNC: "trunc",
    Op.ROUND: "rint",  # half to even in the default rounding mode, like torch.round
}
_LIBM_BINARY = {Op.POW: "pow", Op.ATAN2: "atan2", Op.FMOD: "fmod"}
_COMPARISONS = {Op.EQ: "==", Op.NE: "!=", Op.LT: "<", Op.LE: "<=", Op.GT: ">", Op.GE: ">="}
_BITWISE = {Op.BITWISE_AND: "&", Op.BITWISE_OR: "|", Op.BITWISE_XOR: "^"}
_WRAPPING = {Op.ADD: "kiln_wrap_add", Op.SUB: "kiln_wrap_sub", Op.MUL: "kiln_wrap_mul"}
_INTEGER_HELPERS = {
    Op.FLOOR_DIV: "kiln_floordiv_int",
    Op.REMAINDER: "kiln_remainder_int",
    Op.FMOD: "kiln_fmod_int",
    Op.POW: "kiln_pow_int",
    Op.SHIFT_LEFT: "kiln_shift_left",
    Op.SHIFT_RIGHT: "kiln_shift_right",
}
_FLOAT_HELPERS = {
    Op.FLOOR_DIV: "kiln_floordiv_float",
    Op.REMAINDER: "kiln_remainder_float",
    Op.MAXIMUM: "kiln_maximum",
    Op.MINIMUM: "kiln_minimum",
    Op.ERFINV: "kiln_erfinv",
}


def _one(dtype: torch.dtype) -> str:
    return "1.0" if dtype == torch.float64 else "1.0f"


def _float_op(op: Op, args: list[str], dtype: torch.dtype) -> str | None:
    suffix = "" if dtype == torch.float64 else "f"
    one = _one(dtype)
    a = args[0]
    if op in _LIBM_UNARY:
        return f"{_LIBM_UNARY[op]}{suffix}({a})"
    if op in _LIBM_BINARY:
        return f"{_LIBM_BINARY[op]}{suffix}({a}, {args[1]})"
    if op in _FLOAT_HELPERS:
        return f"{_FLOAT_HELPERS[op]}({', '.join(args)})"
    simple = {
        Op.NEG: f"(-{a})",
        Op.ABS: f"fabs{suffix}({a})",
        Op.RSQRT: f"({one} / sqrt{suffix}({a}))",
        Op.RECIPROCAL: f"({one} / {a})",
        Op.SIGMOID: f"({one} / ({one} + exp{suffix}(-{a})))",
        Op.SIGN: f"({compute_type(dtype)})((0 < {a}) - ({a} < 0))",
        Op.ISNAN: f"({a} != {a})",
        Op.ISINF: f"(fabs{suffix}({a}) == INFINITY)",
    }
    if op in simple:
        return simple[op]
    if len(args) == 2:
        b = args[1]
        arithmetic = {Op.ADD: "+", Op.SUB: "-", Op.MUL: "*", Op.DIV: "/"}
        if op in arithmetic:
            return f"({a} {arithmetic[op]} {b})"
    return None


def _integer_op(op: Op, args: list[str], dtype: torch.dtype) -> str | None:
    a = args[0]
    if op in {Op.FLOOR, Op.CEIL, Op.ROUND, Op.TRUNC}:
        return a
    unary = {
        Op.NEG: f"kiln_wrap_neg({a})",
        Op.ABS: f"kiln_wrap_abs({a})",
        Op.SIGN: f"({storage_type(dtype)})((0 < {a}) - ({a} < 0))",
        Op.BITWISE_NOT: f"({storage_type(dtype)})(~{a})",
        Op.ISNAN: "false",
        Op.ISINF: "false",
    }
    if op in unary:
        return unary[op]
    b = args[1] if len(args) == 2 else ""
    if op in _WRAPPING:
        return f"{_WRAPPING[op]}({a}, {b})"
    if op in _INTEGER_HELPERS:
        return f"{_INTEGER_HELPERS[op]}({a}, {b})"
    if op in _BITWISE:
        return f"({storage_type(dtype)})({a} {_BITWISE[op]} {b})"
    if op is Op.MAXIMUM:
        return f"({a} > {b} ? {a} : {b})"
    if op is Op.MINIMUM:
        return f"({a} < {b} ? {a} : {b})"
    return None


def _bool_op(op: Op, args: list[str]) -> str | None:
    a = args[0]
    b = args[1] if len(args) == 2 else ""
    table = {
        Op.SIGN: a,
        Op.ABS: a,
        Op.ISNAN: "false",
        Op.ISINF: "false",
        Op.BITWISE_NOT: f"(!{a})",
        Op.ADD: f"({a} | {b})",  # bitwise, not short-circuit: branch-free, so it vectorizes
        Op.MUL: f"({a} & {b})",
        Op.MAXIMUM: f"({a} | {b})",
        Op.MINIMUM: f"({a} & {b})",
        Op.BITWISE_AND: f"({a} & {b})",
        Op.BITWISE_OR: f"({a} | {b})",
        Op.BITWISE_XOR: f"({a} != {b})",
    }
    return table.get(op)


def spell(op: Op, args: list[str], dtype: torch.dtype) -> str:
    """The C++ expression of elementwise ``op`` on compute-type ``args`` whose dtype is
    ``dtype`` (WHERE: the values' dtype; CONVERT is :func:`convert`)."""
    if op is Op.WHERE:
        return f"({args[0]} ? {args[1]} : {args[2]})"
    if op in _COMPARISONS:
        return f"({args[0]} {_COMPARISONS[op]} {args[1]})"
    if op is Op.LOGICAL_NOT:
        return f"({args[0]} == 0)"
    logical = {Op.LOGICAL_AND: "&", Op.LOGICAL_OR: "|", Op.LOGICAL_XOR: "!="}
    if op in logical:
        return f"(({args[0]} != 0) {logical[op]} ({args[1]} != 0))"
    if dtype.is_floating_point:
        text = _float_op(op, args, dtype)
    elif dtype == torch.bool:
        text = _bool_op(op, args)
    else:
        text = _integer_op(op, args, dtype)
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
)
