"""Proxy tensors: stand-ins that record what a program does to them into a graph.

A :class:`ProxyTensor` is a ``torch.Tensor`` subclass with no storage (so ``isinstance(x,
torch.Tensor)`` holds in user code) whose ``__torch_function__`` sends every torch call to the
translation table. Shape, dtype and device queries are answered from its type; anything that
needs data (``bool(x)``, ``x.item()``) is data-dependent control flow and raises
:class:`~kiln.errors.TraceError` naming the user's line.

In-place ops are functionalized: the proxy is rebound to the new value. Views remember their
root and how to recompute themselves from it, so a view stays current after its root is
mutated, and an in-place op on a view writes through to the root (through the element
positions of the view, found by applying the same view to an ``iota`` of the root).
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.errors import (
    KilnError,
    OpaqueCallError,
    OpNotImplementedError,
    TraceError,
    op_error,
)
from kiln.frontends.sizes import LAYOUT_QUERIES, layout_query, size_query
from kiln.frontends.source import user_location
from kiln.frontends.writes import assign, write_constant
from kiln.ir import symbolic
from kiln.ir.builder import active_builder, require_builder
from kiln.ir.graph import Origin, Value
from kiln.ir.ranges import known_truth
from kiln.ir.symbolic import Sym
from kiln.ir.types import hint_shape
from kiln.ops import prims
from kiln.ops.translations import (
    FallbackToExtern,
    api_name,
    collect_assignments,
    finish_assignments,
    lookup,
)
from kiln.ops.translations.common import on_one_device
from kiln.ops.translations.creation import RANDOM_FACTORIES

# Metadata queries answered from the proxy's type without touching data.
_NATIVE_METHODS = {
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndimension,
    torch.Tensor.numel,
    torch.Tensor.nelement,
    torch.Tensor.stride,
    torch.Tensor.is_contiguous,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
    torch.Tensor.element_size,
    torch.Tensor.get_device,
    torch.Tensor.__len__,
    torch.Tensor.is_signed,
    torch.Tensor.storage_offset,
    torch.is_floating_point,
    torch.is_complex,
    torch.is_signed,
    torch.numel,
}
_NATIVE_PROPERTIES = {
    "shape",
    "dtype",
    "device",
    "ndim",
    "is_cuda",
    "is_cpu",
    "is_meta",
    "requires_grad",
    "layout",
    "is_sparse",
    "is_quantized",
    "is_mkldnn",
    "is_nested",
    "names",
    "itemsize",
    "is_leaf",
    "grad_fn",
    "output_nr",
    "_version",
    "is_mps",
    "is_xpu",
    "nbytes",
}
_DATA_ACCESS = {
    torch.Tensor.__bool__,
    torch.Tensor.item,
    torch.Tensor.tolist,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.numpy,
    torch.Tensor.data_ptr,
    torch.Tensor.__array__,
    torch.Tensor.__complex__,
}


# Calls that change a tensor's place in autograd's graph rather than compute a value.
_AUTOGRAD_LEAVES = {torch.Tensor.requires_grad_, torch.Tensor.retain_grad}


class ProxyTensor(torch.Tensor):
    """A tensor value of the graph being traced."""

    _value: Value
    _root: ProxyTensor | None  # the tensor this is a view of, or None
    _replay: Callable[[Value], Value] | None  # recomputes this view from the root's value
    _seen_version: int
    _mutations: int
    _initial: Value  # the value it had when tracing began (the graph input, for inputs)
    # For views: (torch callable, args, kwargs, output index or None) that made this view.
    _view_call: tuple[Any, tuple[Any, ...], dict[str, Any], int | None] | None
    _input_type: type  # set by bytecode capture on proxies of its input tensors
    _is_param: bool
    _leaf: bool  # an input that is a leaf requiring grad (eager refuses in-place writes to it)
    # An input's strides, which stride queries answer (None: a value the graph computes,
    # whose layout is the compiled program's choice: the query breaks the graph).
    _strides: tuple[int, ...] | None

    @staticmethod
    def __new__(cls, value: Value) -> ProxyTensor:
        kind = value.type
        proxy = torch.Tensor._make_wrapper_subclass(
            cls,
            hint_shape(kind.shape),  # (size queries answer symbolic sizes: size_query)
            dtype=kind.dtype,
            device=kind.device,
            requires_grad=kind.requires_grad,
        )
        proxy._value = value
        proxy._initial = value
        proxy._root = None
        proxy._replay = None
        proxy._seen_version = 0
        proxy._mutations = 0
        proxy._view_call = None
        proxy._strides = None
        proxy._leaf = False
        return proxy

    def current(self) -> Value:
        """This tensor's value now, recomputed from its root if the root was mutated."""
        root = self._root
        if root is not None and self._replay is not None and root._mutations != self._seen_version:
            self._value = self._replay(root.current())
            self._seen_version = root._mutations
        return self._value

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise TraceError(f"internal: {func} reached tensor data of a proxy", user_location())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return dispatch(func, tuple(args), dict(kwargs or {}))


# The wrappers ``kiln.trace`` puts on torch.Tensor's sized methods while it traces -> the
# methods they wrap (``frontends/trace.py``: ``_sized_calls``); overrides are handed the wrapper.
ROUTED: dict[Any, Any] = {}


class TraceMode(torch.overrides.TorchFunctionMode):
    """Routes every torch call that touches a proxy, or draws random numbers, to ``dispatch``;
    other calls (factories of constants such as ``torch.arange(4)``) run normally, and
    ``on_constant`` (when given) sees each tensor they return: bytecode capture keeps them
    apart from tensors it reached without reading them through a source."""

    def __init__(
        self,
        on_constant: Callable[[torch.Tensor], None] | None = None,
        is_constant: Callable[[torch.Tensor], bool] | None = None,
        writable: Callable[[torch.Tensor], bool] | None = None,
    ) -> None:
        super().__init__()
        self.on_constant = on_constant
        self.is_constant = is_constant
        self.writable = writable  # whether a constant may become a graph value when written

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        func = ROUTED.get(func, func)
        kwargs = dict(kwargs or {})
        leaves = pytree.tree_leaves((args, kwargs))
        real = [a for a in leaves if isinstance(a, torch.Tensor) and not isinstance(a, ProxyTensor)]
        if self.is_constant is not None and real and _autograd_state(func):
            # torch code run natively (an optimizer's zero_grad) reading or writing a real
            # tensor's .grad: no guard holds what it saw, no replay redoes what it wrote
            raise OpaqueCallError(
                f"{api_name(func)} of a tensor's autograd state (.grad) inside torch code",
                user_location(),
            )
        if self.is_constant is not None and not _native(func):
            unknown = [
                leaf
                for leaf in leaves
                if isinstance(leaf, torch.Tensor)
                and not isinstance(leaf, ProxyTensor)
                and not self.is_constant(leaf)
            ]
            if unknown:
                # A tensor reached without an access path (an item of a native iterator, a
                # gradient in optimizer state) or that cannot be a graph input (sparse): used
                # as a constant, it would replay this call's values on every call.
                raise OpaqueCallError(
                    f"{api_name(func)} of a tensor capture cannot read as a graph input",
                    user_location(),
                )
        sized = any(isinstance(leaf, Sym) for leaf in leaves)  # (torch.arange(x.size(1)))
        if func in RANDOM_FACTORIES or sized or any(_traced(leaf) for leaf in leaves):
            target = args[0] if args else None
            if (
                self.writable is not None
                and isinstance(target, torch.Tensor)
                and not isinstance(target, ProxyTensor)
                and (getattr(lookup(func), "inplace", False) or _functional_twin(func) is not None)
                and not self.writable(target)
            ):
                raise TraceError(
                    f"data-dependent value: {api_name(func)} writes traced values into a view "
                    "of a constant tensor",
                    user_location(),
                )
            return dispatch(func, tuple(args), kwargs)
        result = func(*args, **kwargs)
        if self.on_constant is not None:
            for leaf in result if isinstance(result, tuple | list) else (result,):
                if isinstance(leaf, torch.Tensor):
                    self.on_constant(leaf)
        return result


def _traced(leaf: Any) -> bool:
    """A proxy, or a constant the program has written traced values into (a graph value)."""
    if isinstance(leaf, ProxyTensor):
        return True
    if not isinstance(leaf, torch.Tensor):
        return False
    builder = active_builder()
    return builder is not None and builder.written_constant(leaf) is not None


def _native(func: Any) -> bool:
    if func in _NATIVE_METHODS:
        return True
    name = getattr(getattr(func, "__self__", None), "__name__", None)
    return getattr(func, "__name__", "") == "__get__" and name in _NATIVE_PROPERTIES


def _describe(proxy: ProxyTensor) -> str:
    return f"ProxyTensor({proxy._value.name}: {proxy._value.type})"


def _size_tensor(size: Sym) -> Any:
    """A symbolic size as a 0-dim int64 graph value (for ``x * n``: see ``symbolic.as_tensor``)."""
    return dispatch(torch.full, ((), size), {"dtype": torch.int64})


symbolic.as_tensor = _size_tensor


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on proxies: answer metadata natively, translate everything else."""
    func = ROUTED.get(func, func)
    if func in LAYOUT_QUERIES and args and isinstance(args[0], ProxyTensor):
        proxy = args[0]
        answer = layout_query(func, proxy._value.type.shape, proxy._strides, args[1:], kwargs)
        if answer is NotImplemented:
            raise OpaqueCallError(
                f"{api_name(func)} of a tensor the graph computes (its strides are the "
                "compiled program's choice, so eager answers, after a graph break)",
                user_location(),
            )
        return answer
    sized = args and isinstance(args[0], ProxyTensor) and args[0]._value.type.is_symbolic
    if sized and _native(func):
        answer = size_query(func, args[0]._value.type.shape, args, kwargs)
        if answer is not NotImplemented:
            return answer
    if _native(func) or (func is torch.Tensor.type and len(args) == 1 and not kwargs):
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)
    if func is torch.Tensor.__bool__ and isinstance(args[0], ProxyTensor):
        known = known_truth(args[0]._value)  # (``torch.rand([]) < 0.0``: False on every call)
        if known is not None:
            return known
    if func in _DATA_ACCESS:
        what = getattr(func, "__name__", str(func))
        raise TraceError(
            f"data-dependent control flow: {what}() needs the value of a traced tensor, which "
            "symbolic tracing does not have (use kiln.compile, which breaks the graph there)",
            user_location(),
        )
    if func in (torch.Tensor.__repr__, torch.Tensor.__str__, torch.Tensor.__format__):
        return _describe(args[0])
    if func in _AUTOGRAD_LEAVES:
        # A new autograd leaf (or hooks on one): eager autograd must see the real tensor.
        raise OpaqueCallError(
            f"{api_name(func)} on a traced tensor changes what autograd records", user_location()
        )
    if isinstance(kwargs.get("generator"), torch.Generator):
        # The numbers belong to the user's generator and its state: PyTorch must draw them.
        raise OpaqueCallError(
            f"{api_name(func)} draws from a torch.Generator, which only PyTorch can advance",
            user_location(),
        )
    out = kwargs.get("out")
    if isinstance(out, ProxyTensor):  # f(..., out=t): t.copy_(f(...)), returning t
        kwargs = {k: v for k, v in kwargs.items() if k != "out"}
        return _write_into(out, dispatch(func, args, kwargs), api_name(func))
    twin = _functional_twin(func)
    if twin is not None and args and isinstance(args[0], torch.Tensor):
        # x.foo_(...) without a translation of its own: x takes foo's result (cast to x's
        # dtype, which must hold it, and x's shape, as eager requires)
        result = dispatch(twin, args, kwargs)
        if isinstance(result, ProxyTensor):
            api = api_name(func)
            operand = args[0]
            if tuple(result.shape) != tuple(operand.shape) or (
                result.dtype != operand.dtype
                and (
                    func is torch.Tensor.float_power_  # (it refuses to cast its double result)
                    or not torch.can_cast(result.dtype, operand.dtype)
                )
            ):
                # eager raises, or resizes the operand (addbmm_): PyTorch runs it, and decides
                raise OpaqueCallError(
                    f"{api}: the result's shape or dtype is not its operand's", user_location()
                )
            with require_builder().origin_scope(Origin(api)):
                if not isinstance(operand, ProxyTensor):  # a constant written with graph values
                    return write_constant(operand, result.current(), api)
                return assign(operand, result.current(), api)
    builder = require_builder()
    location = user_location()
    origin = Origin(
        api_name(func), location.file if location else "", location.line if location else 0
    )
    by_value: dict[Value, ProxyTensor] = {}
    devices: set[torch.device] = set()
    values = pytree.tree_map(lambda item: _unwrap(item, by_value, devices), (args, kwargs))
    entry = lookup(func)
    with builder.origin_scope(origin):
        token = collect_assignments()
        try:
            external = True
            if entry is None or _complex(values) or not _binds(entry.fn, values[0], values[1]):
                # (a translation whose signature lacks an argument torch accepts: PyTorch's
                # own call is right, whatever the translation would have done)
                result = _extern(func, *values)
            else:
                try:
                    if len(devices) > 1:
                        values = _on_one_device(values)
                    result = entry.fn(*values[0], **values[1])
                    external = False
                except FallbackToExtern:
                    result = _extern(func, *values)
                except OpNotImplementedError:
                    if not _exotic(values):
                        raise  # (eager rejects it too: float & float)
                    result = _extern(func, *values)  # uint8 arithmetic: PyTorch computes it
        except KilnError as error:
            if error.location is None and location is not None:
                error.location = location
                error.args = (f"{error.message}\n  at {location}",)
            raise
        except (TypeError, ValueError, RuntimeError, IndexError, NotImplementedError) as error:
            raise op_error(f"{origin.api}: {error}", error, location) from error
        finally:
            assignments = finish_assignments(token)
        rebound: dict[Value, ProxyTensor] = {}
        for target, new, untracked in assignments:
            with torch.no_grad() if untracked else contextlib.nullcontext():
                rebound[new] = assign(by_value[target], new, origin.api)
        if isinstance(result, Value) and result in rebound:
            return rebound[result]  # F.elu(x, inplace=True) returns x itself, as eager
        if entry is not None and entry.inplace:
            if isinstance(args[0], torch.Tensor) and not isinstance(args[0], ProxyTensor):
                # A constant (made from Python data) written with traced values: its value
                # is a graph value from now on; the tensor object stays the program's.
                return write_constant(args[0], result, origin.api)
            return assign(args[0], result, origin.api)
    view = entry is not None and not external and entry.is_view(*values)
    if not view and _may_alias(result, by_value, external):
        with builder.origin_scope(origin):
            return _eager_identity(func, args, kwargs, result, by_value)
    wrapped = pytree.tree_map(_wrap, result)
    if view and isinstance(wrapped, ProxyTensor | tuple | list):
        assert entry is not None
        _mark_views(wrapped, args, kwargs, entry.fn, func)
    return wrapped


# In-place methods that change the tensor's metadata (shape, strides, storage), not its values.
_RESHAPING_IN_PLACE = frozenset(
    {
        "squeeze_",
        "unsqueeze_",
        "transpose_",
        "t_",
        "swapaxes_",
        "swapdims_",
        "as_strided_",
        "resize_",
        "resize_as_",
        "set_",
        "detach_",
        "requires_grad_",
        "share_memory_",
        "rename_",
    }
)


# A leaf's accumulated gradient, which neither guards nor the graph hold, read or written by
# torch's own Python code that capture runs natively (an optimizer's zero_grad; the user's
# ``x.grad`` is read by capture itself, guarded).
_AUTOGRAD_ATTRIBUTES = frozenset({"grad", "_grad"})


def _autograd_state(func: Any) -> bool:
    owner = getattr(getattr(func, "__self__", None), "__name__", None)
    return getattr(func, "__name__", "") in ("__get__", "__set__", "__delete__") and (
        owner in _AUTOGRAD_ATTRIBUTES
    )


def _functional_twin(func: Any) -> Any:
    """``torch.Tensor.foo`` for an in-place ``torch.Tensor.foo_`` that has no translation of its
    own (``xlogy_``, ``scatter_reduce_``), else None."""
    name = getattr(func, "__name__", "")
    if (
        not name.endswith("_")
        or name.startswith("_")
        or name in _RESHAPING_IN_PLACE
        or getattr(torch.Tensor, name, None) is not func
        or lookup(func) is not None
    ):
        return None
    return getattr(torch.Tensor, name[:-1], None)


def _on_one_device(values: Any) -> Any:
    """The operands with 0-d CPU tensors moved to the device of the others, which eager reads
    as scalars (``x_cuda / torch.tensor(8.0).sqrt()``); translations see one device."""
    leaves, structure = pytree.tree_flatten(values)
    tensors = [leaf for leaf in leaves if isinstance(leaf, Value)]
    moved = dict(zip(map(id, tensors), on_one_device(*tensors), strict=True))
    return pytree.tree_unflatten(
        [moved.get(id(leaf), leaf) if isinstance(leaf, Value) else leaf for leaf in leaves],
        structure,
    )


def _may_alias(result: Any, by_value: dict[Value, ProxyTensor], external: bool) -> bool:
    """Whether eager's result may be an operand itself or a view of it: a translation handed an
    operand back unchanged, or a PyTorch call (which may return views: ``hsplit``, ``ravel``)
    on tensors."""
    if external and by_value:
        return True
    return any(leaf in by_value for leaf in pytree.tree_leaves(result) if isinstance(leaf, Value))


# Elements up to which an op without a meta kernel runs on zeros to learn its aliasing.
_REAL_STAND_IN_LIMIT = 1 << 16


def _eager_identity(
    func: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    result: Any,
    by_value: dict[Value, ProxyTensor],
) -> Any:
    """A translation handed an operand back unchanged (a sum over no dims, ``contiguous()``,
    a roll by 0). Eager returns that same tensor object, a new view of it, or new memory,
    depending on the op; running it on meta tensors says which, and the result follows."""
    metas: dict[int, torch.Tensor] = {}
    owners: dict[int, ProxyTensor] = {}

    def stand_in(item: Any, device: str) -> Any:
        if isinstance(item, Sym):  # (whether eager aliases does not depend on the size)
            return item.hint
        if not isinstance(item, ProxyTensor):
            return item
        if id(item) not in metas:
            shape = hint_shape(item.current().type.shape)
            meta = torch.zeros(shape, dtype=item.dtype, device=device)
            if item.requires_grad and torch.is_grad_enabled():
                meta.requires_grad_()  # (eager's outputs say which are differentiable)
            metas[id(item)] = meta
            owners[id(meta)] = item
        return metas[id(item)]

    def run(device: str) -> list[torch.Tensor | None]:
        metas.clear()
        owners.clear()
        stand_ins = pytree.tree_map(lambda item: stand_in(item, device), (args, kwargs))
        eager = func(*stand_ins[0], **stand_ins[1])
        return [leaf for leaf in pytree.tree_leaves(eager) if isinstance(leaf, torch.Tensor)]

    try:
        answers = run("meta")
    except NotImplementedError:  # no meta kernel (histogramdd): small operands run for real
        small = sum(t.numel() for t in by_value.values()) <= _REAL_STAND_IN_LIMIT
        try:
            answers = run("cpu") if small else []
        except Exception:
            answers = []
    except Exception:
        answers = []
    leaves, structure = pytree.tree_flatten(result)
    values = [leaf for leaf in leaves if isinstance(leaf, Value)]
    if len(answers) != len(values):
        answers = [None] * len(values)  # (no answer: new memory, never an alias)
    answer = dict(zip(map(id, values), answers, strict=True))
    settled = []
    for index, leaf in enumerate(leaves):
        if not isinstance(leaf, Value):
            settled.append(leaf)
            continue
        eager_leaf = answer[id(leaf)]
        if eager_leaf is not None and leaf.type.requires_grad and not eager_leaf.requires_grad:
            leaf.type = leaf.type.with_(requires_grad=False)  # (lu's permutation, norm stats)
        if eager_leaf is not None and id(eager_leaf) in owners:
            settled.append(owners[id(eager_leaf)])  # the same tensor object
            continue
        base = _memory_owner(eager_leaf, list(metas.values())) if eager_leaf is not None else None
        if base is not None:  # a new tensor on the operand's memory (a view, unsafe_split)
            # (a 1-tuple result is indexed too: meshgrid(x) returns (view,))
            view_call = (func, args, kwargs, None if isinstance(result, Value) else index)
            settled.append(_view_of(leaf, owners[id(base)], by_value, view_call, index))
        elif leaf in by_value:  # new memory holding the operand's values
            copied = prims.convert(leaf, dtype=leaf.type.dtype)
            settled.append(ProxyTensor(copied))
        else:
            settled.append(ProxyTensor(leaf))
    return pytree.tree_unflatten(settled, structure)


def _memory_owner(eager: torch.Tensor, stand_ins: list[torch.Tensor]) -> torch.Tensor | None:
    """The operand stand-in whose memory ``eager`` (a meta result) shares: its view base, or
    the one with the same storage (``unsafe_split`` returns non-view tensors on it)."""
    if eager._is_view() and any(eager._base is meta for meta in stand_ins):
        return eager._base
    storage = eager.untyped_storage()._cdata
    return next((m for m in stand_ins if m.untyped_storage()._cdata == storage), None)


def _view_of(
    value: Value,
    base: ProxyTensor,
    by_value: dict[Value, ProxyTensor],
    view_call: tuple[Any, tuple[Any, ...], dict[str, Any], int | None],
    index: int,
) -> ProxyTensor:
    """``value`` as a view of ``base`` (eager returned one): recomputed from the root when the
    root is written in place, re-created from the caller's tensor when it leaves the graph."""
    proxy = ProxyTensor(value)
    root = base._root if base._root is not None else base
    base_replay = base._replay
    func, args, kwargs, _ = view_call
    if value in by_value:

        def replay(root_value: Value) -> Value:  # the view is the operand itself
            return base_replay(root_value) if base_replay is not None else root_value

    else:

        def replay(root_value: Value) -> Value:  # PyTorch's call again, on the new values
            current = base_replay(root_value) if base_replay is not None else root_value
            operands = pytree.tree_map(
                lambda a: current if a is base else _unwrap(a), (args, kwargs)
            )
            again = _extern(func, *operands)
            return again if isinstance(again, Value) else pytree.tree_leaves(again)[index]

    proxy._root, proxy._replay = root, replay
    proxy._seen_version = root._mutations
    proxy._view_call = view_call
    return proxy


# The dtypes prims compute in (others, such as uint8, are only converted from and to).
PRIM_DTYPES = frozenset(
    {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64}
    | {torch.bool}
)


def _complex(values: Any) -> bool:
    """Whether a call involves complex numbers (an operand, or a dtype to convert to): prims
    are real, so PyTorch runs it (an extern, differentiated by PyTorch's autograd)."""
    for leaf in pytree.tree_leaves(values):
        if isinstance(leaf, Value) and leaf.type.dtype.is_complex:
            return True
        if isinstance(leaf, torch.dtype) and leaf.is_complex:
            return True
    return False


def _exotic(values: Any) -> bool:
    """Whether an operand has a dtype prims do not compute in (uint8, int8, int16...)."""
    return any(
        isinstance(leaf, Value) and leaf.type.dtype not in PRIM_DTYPES
        for leaf in pytree.tree_leaves(values)
    )


_SIGNATURES: dict[Any, inspect.Signature | None] = {}


def _binds(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``fn`` accepts these arguments (a translation's signature may miss one)."""
    if fn not in _SIGNATURES:
        try:
            _SIGNATURES[fn] = inspect.signature(fn)
        except (TypeError, ValueError):
            _SIGNATURES[fn] = None
    signature = _SIGNATURES[fn]
    if signature is None:
        return True
    try:
        signature.bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def _extern(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """An ``extern`` node calling ``func``; a call no node can hold (one that writes to an
    operand, returns Python values, or fails without data) raises :class:`OpaqueCallError`,
    so bytecode capture runs it natively (eager raises its own error if the call is wrong)."""
    from kiln.ops.externs import extern_call

    name = getattr(func, "__name__", "")
    if name.endswith("_") and not name.endswith("__"):
        # (torch._foreach_mul_ on FakeTensors leaves their version counters alone, so the
        # extern's purity check cannot see the write: the name says it)
        raise OpaqueCallError(
            f"{api_name(func)} cannot be a graph node: it writes to an operand in place",
            user_location(),
        )
    try:
        return extern_call(func, args, kwargs)
    except TraceError:
        raise
    except (KilnError, TypeError, ValueError, RuntimeError, IndexError, NotImplementedError) as e:
        detail = e.message if isinstance(e, KilnError) else str(e)
        raise OpaqueCallError(
            f"{api_name(func)} cannot be a graph node: {detail}", user_location()
        ) from e


def _unwrap(
    item: Any, seen: dict[Value, ProxyTensor] | None = None, devices: set[Any] | None = None
) -> Any:
    if isinstance(item, ProxyTensor):
        value = item.current()
        if seen is not None:
            seen[value] = item
    elif isinstance(item, torch.Tensor):
        value = require_builder().constant(item)
    else:
        return item
    if devices is not None:
        devices.add(value.type.device)
    return value


def _wrap(item: Any) -> Any:
    return ProxyTensor(item) if isinstance(item, Value) else item


def _write_into(out: ProxyTensor, result: Any, api: str) -> ProxyTensor:
    """``out=``: the result written into ``out`` in place (as an in-place op would)."""
    if not isinstance(result, ProxyTensor) or tuple(result.shape) != tuple(out.shape):
        raise OpaqueCallError(f"{api} with out= of another shape (eager resizes it)")
    with require_builder().origin_scope(Origin(api)):
        return assign(out, result.current(), api)


def _mark_views(
    result: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    fn: Callable[..., Any],
    func: Any = None,
) -> None:
    """Record that ``result`` views ``args[0]``, how to recompute it from the root, and the
    torch call that made it (``_view_call``: generated code re-creates views of inputs with it,
    so they alias the caller's tensor as in eager)."""
    source = args[0]
    if not isinstance(source, ProxyTensor):
        return
    root = source._root if source._root is not None else source
    source_replay = source._replay

    outputs, _ = pytree.tree_flatten(result)
    for index, output in enumerate(outputs):
        if not isinstance(output, ProxyTensor):
            continue

        def replay(root_value: Value, index: int = index) -> Value:
            base = source_replay(root_value) if source_replay is not None else root_value
            rest = pytree.tree_map(_unwrap, (args[1:], kwargs))
            values, _ = pytree.tree_flatten(fn(base, *rest[0], **rest[1]))
            return values[index]

        output._root = root
        output._replay = replay
        output._seen_version = root._mutations
        single = isinstance(result, ProxyTensor)  # (split into one chunk returns (view,))
        output._view_call = (func, args, kwargs, None if single else index)
