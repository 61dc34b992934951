"""Translations of attention: F.scaled_dot_product_attention and F.multi_head_attention_forward
(what ``nn.MultiheadAttention`` calls).

Without dropout, scaled dot-product attention is the extern prim ``sdpa``. With dropout it is
decomposed the way eager's math kernel computes it -- scores by a batched product, the mask
applied (``where`` for a boolean or causal mask, ``add`` for a float one), softmax, dropout from
the graph's random stream, and a second product -- so every call of the graph draws new
numbers::

    F.scaled_dot_product_attention(q, k, v)       # sdpa(q, k, v, None, is_causal=False, ...)
    F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)
    t0 = permute(k, ...); t1 = bmm(...); t2 = mul(t1, 0.35); ... softmax ...
    t9 = random_uniform(rng_seed, ...); t10 = ge(t9, 0.1); t11 = where(t10, ..., 0.0); ...

Multi-head attention follows ``F.multi_head_attention_forward`` step by step (projections with
F.linear, heads split by reshape and permute, masks merged into one float mask); it ends in
``sdpa`` when no weights are asked for, else in explicit scores and softmax so the averaged
weights can be returned. ``bias_k``/``bias_v``, ``add_zero_attn`` and ``static_k``/``static_v``
fall back to an extern.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kiln.ir.builder import require_builder
from kiln.ir.graph import Value
from kiln.ir.types import Dim, Shape
from kiln.ops import prims
from kiln.ops.translations import common
from kiln.ops.translations.cases import Case, T, case_calls
from kiln.ops.translations.linalg import (
    baddbmm,
    batched_matmul,
    bmm,
    linear,
    reshape,
    transpose_last,
)
from kiln.ops.translations.normalization import softmax_of
from kiln.ops.translations.reductions import compute_dtype
from kiln.ops.translations.shape import shape_of
from kiln.ops.translations.table import FallbackToExtern, translation


def dropout(x: Value, p: float) -> Value:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``."""
    if p <= 0:
        return x
    if p >= 1:
        return prims.mul(x, 0.0)
    builder = require_builder()
    shape = x.type.shape
    offset = builder.rng_offset(x.type.numel())
    uniform = prims.random_uniform(
        builder.rng_seed(), shape=shape, dtype=torch.float32, device=x.type.device, offset=offset
    )
    keep = prims.ge(uniform, p)
    return prims.where(keep, prims.mul(x, 1.0 / (1.0 - p)), 0.0)


# ---------------------------------------------------------------------------------------------
# scaled dot-product attention


def _check_attention_operands(q: Value, k: Value, v: Value) -> None:
    dtypes = {q.type.dtype, k.type.dtype, v.type.dtype}
    if len(dtypes) > 1:
        raise RuntimeError(
            "Expected query, key, and value to have the same dtype, but got query.dtype: "
            f"{q.type.dtype} key.dtype: {k.type.dtype} and value.dtype: {v.type.dtype} instead."
        )
    if not q.type.dtype.is_floating_point:
        raise RuntimeError(f"expected scalar type Float but found {q.type.dtype}")


def _repeat_heads(x: Value, groups: Dim) -> Value:
    """Each head of ``x`` (..., heads, seq, dim) repeated ``groups`` times in place."""
    if groups == 1:
        return x
    *lead, heads, seq, dim = shape_of(x)
    rank = x.type.rank
    grown = common.broadcast_to(
        prims.unsqueeze(x, dims=(rank - 2,)), (*lead, heads, groups, seq, dim)
    )
    return reshape(grown, (*lead, heads * groups, seq, dim))


def _causal_mask(length: Dim, source: Dim, device: torch.device) -> Value:
    """True where query ``i`` may attend key ``j`` (``j <= i``, top-left aligned, as eager)."""
    rows = prims.iota(length=length, start=0, step=1, dtype=torch.int64, device=device)
    cols = prims.iota(length=source, start=0, step=1, dtype=torch.int64, device=device)
    shape = (length, source)
    row = prims.broadcast(rows, shape=shape, dims=(0,))
    col = prims.broadcast(cols, shape=shape, dims=(1,))
    return prims.ge(row, col)


def _apply_mask(scores: Value, mask: Value) -> Value:
    """Masked scores: a boolean mask keeps where True (else ``-inf``), a float mask adds."""
    mask = common.broadcast_to(mask, scores.type.shape)
    if mask.type.dtype == torch.bool:
        hidden = common.full(scores.type.shape, -math.inf, scores.type.dtype, scores.type.device)
        result = prims.where(mask, scores, hidden)
    else:
        result = prims.add(scores, mask)
    return result


def attention_math(
    q: Value,
    k: Value,
    v: Value,
    mask: Value | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> Value:
    """Scaled dot-product attention in prims, with dropout: eager's math kernel."""
    if enable_gqa:
        groups = q.type.shape[-3] // k.type.shape[-3]
        k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    factor = scale if scale is not None else 1.0 / math.sqrt(q.type.shape[-1])
    scores = prims.mul(batched_matmul(q, transpose_last(k)), factor)
    if is_causal:
        length, source = q.type.shape[-2], k.type.shape[-2]
        scores = _apply_mask(scores, _causal_mask(length, source, q.type.device))
    if mask is not None:
        scores = _apply_mask(scores, mask)
    weights = dropout(softmax_of(scores, -1, None, False, "softmax"), dropout_p)
    return batched_matmul(weights, v)


@translation(
    F.scaled_dot_product_attention,
    samples=case_calls(
        ((T((2, 3, 4, 8)), T((2, 3, 6, 8)), T((2, 3, 6, 5))), {}, ""),
        ((T((2, 3, 4, 8)), T((2, 3, 4, 8)), T((2, 3, 4, 8))), {"is_causal": True}, "causal"),
        ((T((3, 4, 8)), T((3, 6, 8)), T((3, 6, 8)), T((4, 6))), {"scale": 0.3}, "float mask"),
        (
            (T((2, 2, 4, 8)), T((2, 2, 6, 8)), T((2, 2, 6, 8))),
            {"attn_mask": T((2, 1, 4, 6), dtype=torch.bool, low=0.0, high=0.4)},
            "bool mask",
        ),
        ((T((2, 4, 4, 8)), T((2, 2, 6, 8)), T((2, 2, 6, 8))), {"enable_gqa": True}, "gqa"),
    ),
)
def scaled_dot_product_attention(
    query: Value,
    key: Value,
    value: Value,
    attn_mask: Value | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Value:
    query, key, value, attn_mask = common.autocast("sdpa", query, key, value, attn_mask)
    _check_attention_operands(query, key, value)
    boolean_mask = attn_mask is not None and attn_mask.type.dtype == torch.bool
    if boolean_mask and query.type.device.type == "cuda":
        # CUDA's fused kernels take additive masks (a boolean one sends PyTorch to the slow
        # math path); True (attend) -> 0, False -> -inf is the same attention.
        attn_mask = _float_mask(prims.logical_not(attn_mask), query.type.dtype, "attn_mask")
    if dropout_p > 0.0:
        return attention_math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)
    return prims.sdpa(
        query, key, value, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )


# ---------------------------------------------------------------------------------------------
# multi-head attention (F.multi_head_attention_forward)


def _float_mask(mask: Value | None, dtype: torch.dtype, name: str) -> Value | None:
    """``_canonical_mask``: a boolean mask becomes ``-inf`` where True, 0 elsewhere."""
    if mask is None:
        return None
    if mask.type.dtype != torch.bool and not mask.type.dtype.is_floating_point:
        raise AssertionError(f"only bool and floating types of {name} are supported")
    if mask.type.dtype != torch.bool:
        return mask
    hidden = common.full(mask.type.shape, -math.inf, dtype, mask.type.device)
    return prims.where(mask, hidden, 0.0)


def _split_rows(x: Value, parts: int) -> list[Value]:
    """``x.chunk(parts)`` along dim 0 (sizes divisible)."""
    size = x.type.shape[0] // parts
    return [_rows(x, i * size, (i + 1) * size) for i in range(parts)]


def _split_last(x: Value, parts: int) -> list[Value]:
    """``x.unflatten(-1, (parts, E))`` split into its ``parts``."""
    size = x.type.shape[-1] // parts
    dim = x.type.rank - 1
    return [prims.slice(x, dim=dim, start=i * size, stop=(i + 1) * size) for i in range(parts)]


def _rows(x: Value, start: Dim, stop: Dim) -> Value:
    return prims.slice(x, dim=0, start=start, stop=stop)


def _in_projection(
    query: Value, key: Value, value: Value, weight: Value, bias: Value | None
) -> list[Value]:
    """``_in_projection_packed``: self-attention runs one linear, encoder-decoder two."""
    embed = query.type.shape[-1]
    if key is value and query is key:
        return _split_last(linear(query, weight, bias), 3)
    if key is value:
        b_q = None if bias is None else _rows(bias, 0, embed)
        b_kv = None if bias is None else _rows(bias, embed, 3 * embed)
        kv = linear(key, _rows(weight, embed, 3 * embed), b_kv)
        return [linear(query, _rows(weight, 0, embed), b_q), *_split_last(kv, 2)]
    biases = [None] * 3 if bias is None else _split_rows(bias, 3)
    pairs = zip((query, key, value), _split_rows(weight, 3), biases, strict=True)
    return [linear(x, w, b) for x, w, b in pairs]


def _separate_projection(
    inputs: tuple[Value, Value, Value], weights: tuple[Value | None, ...], bias: Value | None
) -> list[Value]:
    """``_in_projection`` with ``q_proj_weight``, ``k_proj_weight``, ``v_proj_weight``."""
    present = [w for w in weights if w is not None]
    if len(present) != 3:
        raise AssertionError("use_separate_proj_weight is True but a projection weight is None")
    biases = [None] * 3 if bias is None else _split_rows(bias, 3)
    return [linear(x, w, b) for x, w, b in zip(inputs, present, biases, strict=True)]


def _heads(x: Value, batch: Dim, heads: int) -> Value:
    """(seq, batch, embed) -> (batch * heads, seq, head_dim)."""
    seq, _, embed = shape_of(x)
    split = reshape(x, (seq, batch * heads, embed // heads))
    return prims.permute(split, dims=(1, 0, 2))


def _check_mask_shape(mask: Value, expected: Shape) -> None:
    if tuple(mask.type.shape) != expected:
        raise RuntimeError(
            f"The shape of the {mask.type.rank}D attn_mask is {list(mask.type.shape)}, but "
            f"should be {expected}."
        )


def _attention_mask(
    attn_mask: Value | None,
    key_padding_mask: Value | None,
    batch: Dim,
    heads: int,
    sizes: tuple[Dim, Dim],
) -> Value | None:
    """The 3-d float mask (1 or batch * heads, tgt, src) merging both masks, or None."""
    tgt, src = sizes
    if attn_mask is not None:
        if attn_mask.type.rank == 2:
            _check_mask_shape(attn_mask, (tgt, src))
            attn_mask = prims.unsqueeze(attn_mask, dims=(0,))
        elif attn_mask.type.rank == 3:
            _check_mask_shape(attn_mask, (batch * heads, tgt, src))
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.type.rank} is not supported")
    if key_padding_mask is None:
        return attn_mask
    if tuple(key_padding_mask.type.shape) != (batch, src):
        raise AssertionError(
            f"expecting key_padding_mask shape of {(batch, src)}, but got "
            f"{tuple(key_padding_mask.type.shape)}"
        )
    per_head = common.broadcast_to(
        reshape(key_padding_mask, (batch, 1, 1, src)), (batch, heads, 1, src)
    )
    padding = reshape(per_head, (batch * heads, 1, src))
    if attn_mask is None:
        return padding
    (left, right), _ = common.elementwise(attn_mask, padding)
    return prims.add(left, right)


def _mean_heads(weights: Value) -> Value:
    """Mean over dim 1 (heads), accumulated in float32 for reduced precision, as eager."""
    dtype = weights.type.dtype
    total = prims.sum(common.convert(weights, compute_dtype(dtype)), dims=(1,))
    return common.convert(prims.div(total, common.size_scalar(weights.type.shape[1])), dtype)


def _with_weights(
    q: Value, k: Value, v: Value, mask: Value | None, dropout_p: float
) -> tuple[Value, Value]:
    """Attention with explicit scores: output (batch * heads, tgt, head_dim) and weights."""
    scaled = prims.mul(q, math.sqrt(1.0 / float(q.type.shape[-1])))
    keys = transpose_last(k)
    scores = bmm(scaled, keys) if mask is None else baddbmm(mask, scaled, keys)
    weights = dropout(softmax_of(scores, -1, None, False, "softmax"), dropout_p)
    return bmm(weights, v), weights


def _check_batched(query: Value, key: Value, value: Value, key_padding_mask: Value | None) -> bool:
    """``_mha_shape_check``: whether the inputs are batched (3-d) rather than unbatched (2-d)."""
    rank = query.type.rank
    if rank not in (2, 3):
        raise AssertionError(
            f"query should be unbatched 2D or batched 3D tensor but received {rank}-D query tensor"
        )
    if key.type.rank != rank or value.type.rank != rank:
        raise AssertionError(
            f"For {rank}-D `query`, expected `key` and `value` to be {rank}-D but found "
            f"{key.type.rank}-D and {value.type.rank}-D tensors respectively"
        )
    if key_padding_mask is not None and key_padding_mask.type.rank != rank - 1:
        raise AssertionError(
            f"For {rank}-D `query`, expected `key_padding_mask` to be `None` or {rank - 1}-D but "
            f"found {key_padding_mask.type.rank}-D tensor instead"
        )
    return rank == 3


def _mha_samples(need_weights: bool) -> list[Case]:
    """Sample calls of F.multi_head_attention_forward: embed 8, 2 heads, tgt 3, src 5."""
    packed = (8, 2, T((24, 8)), T((24,)), None, None, False, 0.0, T((8, 8)), T((8,)))
    separate = (8, 2, None, T((24,)), None, None, False, 0.0, T((8, 8)), None)
    weights = {"q_proj_weight": T((8, 8)), "k_proj_weight": T((8, 6)), "v_proj_weight": T((8, 6))}
    qkv = (T((3, 2, 8)), T((5, 2, 8)), T((5, 2, 8)))
    base = {"training": False, "need_weights": need_weights}
    return [
        ((*qkv, *packed), base, "packed"),
        ((*qkv, *packed), {**base, "key_padding_mask": T((2, 5)), "attn_mask": T((3, 5))}, "masks"),
        ((*qkv, *packed), {**base, "attn_mask": T((4, 3, 5), dtype=torch.bool, high=0.3)}, "3-d"),
        (
            (T((3, 2, 8)), T((5, 2, 6)), T((5, 2, 6)), *separate),
            {**base, "use_separate_proj_weight": True, **weights},
            "separate projections",
        ),
        ((T((3, 8)), T((5, 8)), T((5, 8)), *packed), base, "unbatched"),
        (
            (*qkv, *packed),
            {**base, "average_attn_weights": False, "attn_mask": T((3, 5)), "is_causal": True},
            "per-head weights, causal hint",
        ),
    ]


@translation(
    F.multi_head_attention_forward,
    samples=case_calls(*_mha_samples(True), *_mha_samples(False)),
)
def multi_head_attention_forward(
    query: Value,
    key: Value,
    value: Value,
    embed_dim_to_check: int,
    num_heads: int,
    in_proj_weight: Value | None,
    in_proj_bias: Value | None,
    bias_k: Value | None,
    bias_v: Value | None,
    add_zero_attn: bool,
    dropout_p: float,
    out_proj_weight: Value,
    out_proj_bias: Value | None,
    training: bool = True,
    key_padding_mask: Value | None = None,
    need_weights: bool = True,
    attn_mask: Value | None = None,
    use_separate_proj_weight: bool = False,
    q_proj_weight: Value | None = None,
    k_proj_weight: Value | None = None,
    v_proj_weight: Value | None = None,
    static_k: Value | None = None,
    static_v: Value | None = None,
    average_attn_weights: bool = True,
    is_causal: bool = False,
) -> tuple[Value, Value | None]:
    if bias_k is not None or bias_v is not None or static_k is not None or static_v is not None:
        raise FallbackToExtern  # extra key/value rows: rare, not translated
    if add_zero_attn:
        raise FallbackToExtern
    batched = _check_batched(query, key, value, key_padding_mask)
    if not batched:
        query, key, value = (prims.unsqueeze(x, dims=(1,)) for x in (query, key, value))
        if key_padding_mask is not None:
            key_padding_mask = prims.unsqueeze(key_padding_mask, dims=(0,))
    tgt, batch, embed = shape_of(query)
    src = key.type.shape[0]
    key_padding_mask = _float_mask(key_padding_mask, query.type.dtype, "key_padding_mask")
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = _float_mask(attn_mask, query.type.dtype, "attn_mask")
        is_causal = is_causal and key_padding_mask is None
    if embed != embed_dim_to_check or embed % num_heads:
        raise AssertionError(f"embed_dim {embed} does not fit {embed_dim_to_check}, {num_heads}")
    if use_separate_proj_weight:
        projections = (q_proj_weight, k_proj_weight, v_proj_weight)
        q, k, v = _separate_projection((query, key, value), projections, in_proj_bias)
    else:
        if in_proj_weight is None:
            raise AssertionError("use_separate_proj_weight is False but in_proj_weight is None")
        q, k, v = _in_projection(query, key, value, in_proj_weight, in_proj_bias)
    mask = _attention_mask(attn_mask, key_padding_mask, batch, num_heads, (tgt, src))
    q, k, v = (_heads(x, batch, num_heads) for x in (q, k, v))
    dropout_p = dropout_p if training else 0.0
    if need_weights:
        out, weights = _with_weights(q, k, v, mask, dropout_p)
        per_head = reshape(weights, (batch, num_heads, tgt, src))
        result_weights: Value | None = _mean_heads(per_head) if average_attn_weights else per_head
        out = prims.permute(out, dims=(1, 0, 2))
    else:
        if mask is not None:
            rows = mask.type.shape[0]
            queries = mask.type.shape[1]  # tgt, or 1 for a key padding mask alone
            split = (1, 1, queries, src) if rows == 1 else (batch, num_heads, queries, src)
            mask = reshape(mask, split)
        heads = [reshape(x, (batch, num_heads, *x.type.shape[1:])) for x in (q, k, v)]
        out = scaled_dot_product_attention(*heads, mask, dropout_p, is_causal)
        out = prims.permute(out, dims=(2, 0, 1, 3))
        result_weights = None
    out = linear(reshape(out, (tgt * batch, embed)), out_proj_weight, out_proj_bias)
    out = reshape(out, (tgt, batch, out.type.shape[-1]))
    if not batched:
        out = prims.squeeze(out, dims=(1,))
        if result_weights is not None:
            result_weights = prims.squeeze(result_weights, dims=(0,))
    return out, result_weights
