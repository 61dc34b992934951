"""Lazy tensors: ``torch.Tensor`` objects whose ops are recorded, not run, until a step.

A :class:`LazyTensor` holds either data (after a step) or a proxy of a value in the pending
step's graph. Each torch call on lazy tensors goes to the frontend's ``dispatch`` (the same
translation table ``kiln.trace`` and bytecode capture use) on their proxies, inside the
pending step's builder; its results come back as new lazy tensors, or as the operand itself
for in-place ops (the proxy was rebound). Metadata (shape, dtype, ``requires_grad``) is
answered at once; a read of values (``.item()``, ``print``, ``bool`` in an ``if``) first
runs the work it depends on (the step stays pending). ``loss.backward()`` records the reverse
sweep of the step's graph into the same graph (each op's VJP, in prims) and sets the leaves'
``.grad``; an optimizer's update under ``no_grad`` is recorded too, so forward, backward and
update compile as one graph::

    model = kiln.lazy.to_lazy(model)           # parameters become lazy tensors
    loss = F.mse_loss(model(to_lazy(x)), to_lazy(y))
    loss.backward(); opt.step(); opt.zero_grad()
    kiln.lazy.mark_step()                       # compile (or reuse) and run the step
    print(loss.item())
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import Any

import torch
from torch.utils import _pytree as pytree

from kiln.autodiff.reverse import sweep
from kiln.config import logger
from kiln.errors import KilnError, TraceError
from kiln.frontends.proxy import ProxyTensor, dispatch
from kiln.frontends.source import user_location
from kiln.ir.builder import active_builder
from kiln.ir.types import hint_shape
from kiln.lazy.step import PendingStep, counters, run_step
from kiln.ops.translations import api_name

_log = logger("lazy")

# Metadata the wrapper answers itself (its shape, dtype, device and flags are the value's).
_METADATA_PROPERTIES = frozenset(
    {"shape", "dtype", "device", "ndim", "requires_grad", "is_leaf", "grad_fn", "layout"}
    | {"is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested"}
    | {"names", "itemsize", "nbytes", "output_nr", "_version"}
)
_METADATA_METHODS = frozenset(
    {"size", "dim", "ndimension", "numel", "nelement", "__len__"}
    | {"is_floating_point", "is_complex", "is_signed", "element_size", "get_device"}
    | {"requires_grad_", "__hash__"}
)
# Reads of values: the pending work they depend on runs first, then the call, on the data.
# Strides are read off the data too: a program lays out what it computes (eager's layout where
# eager's rules are simple), and the wrapper's own strides are contiguous.
_VALUE_READS = frozenset(
    {"item", "tolist", "numpy", "__array__", "__bool__", "__int__", "__float__", "__index__"}
    | {"__complex__", "__repr__", "__str__", "__format__", "data_ptr"}
    | {"stride", "is_contiguous", "storage_offset"}
)

_serials = itertools.count()
_live: weakref.WeakValueDictionary[int, LazyTensor] = weakref.WeakValueDictionary()
_pending = [PendingStep()]  # (one step at a time; a list so that mark_step can replace it)


class LazyTensor(torch.Tensor):
    """A tensor of the lazy frontend: data after a step, a recorded value during one."""

    _data: torch.Tensor | None  # its value as last computed (None: made in this step, not yet)
    _proxy: ProxyTensor | None  # its value in the pending step's graph
    _epoch: int  # the step ``_proxy`` belongs to
    _leaf: bool  # an autograd leaf: backward() sets its .grad
    _lazy_grad: LazyTensor | None
    _name: str

    @staticmethod
    def __new__(
        cls,
        data: torch.Tensor | None,
        proxy: ProxyTensor | None = None,
        *,
        requires_grad: bool = False,
        leaf: bool = False,
        name: str = "t",
    ) -> LazyTensor:
        if data is not None:
            shape, dtype, device = tuple(data.shape), data.dtype, data.device
        else:
            assert proxy is not None, "a lazy tensor holds data or a recorded value"
            kind = proxy._value.type
            shape, dtype, device = hint_shape(kind.shape), kind.dtype, kind.device
        tensor = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        tensor._data, tensor._proxy, tensor._epoch = data, None, 0
        tensor._leaf, tensor._lazy_grad, tensor._name = leaf, None, name
        if proxy is not None:
            tensor._adopt(proxy)
        _live[next(_serials)] = tensor
        return tensor

    def _adopt(self, proxy: ProxyTensor) -> None:
        proxy._lazy_owner = weakref.ref(self)  # type: ignore[attr-defined]
        self._proxy, self._epoch = proxy, _pending[0].epoch

    def _proxy_in(self, step: PendingStep) -> ProxyTensor:
        """Its value in ``step``'s graph: its data joins the graph as an input on first use."""
        if self._epoch != step.epoch or self._proxy is None:
            assert self._data is not None, "a lazy tensor of a step that never ran"
            value = step.bind(self._data, _native_flag(self), self._name)
            self._adopt(ProxyTensor(value))
        assert self._proxy is not None
        return self._proxy

    def _pending_work(self) -> bool:
        """Whether the pending step changes its value (it was made or written in it)."""
        proxy = self._proxy
        if self._epoch != _pending[0].epoch or proxy is None:
            return False
        with _recording(_pending[0]):
            return self._data is None or proxy.current() is not proxy._initial

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: Any = (), kwargs: Any = None
    ) -> Any:
        raise KilnError(f"internal: {func} reached the data of a lazy tensor", user_location())

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = getattr(func, "__name__", "")
        owner = getattr(getattr(func, "__self__", None), "__name__", None)
        if owner == "grad" and name in ("__get__", "__set__", "__delete__"):
            return _grad_attribute(name, *args)
        if owner == "data" and name == "__set__":  # p.data = new: new values, not recorded
            with torch.no_grad():
                args[0].copy_(args[1])
            return None
        if (name == "__get__" and owner in _METADATA_PROPERTIES) or name in _METADATA_METHODS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.backward:
            return _backward(*args, **kwargs)
        if name in _VALUE_READS:
            _sync(pytree.tree_leaves((args, kwargs)), name)
            data_args, data_kwargs = pytree.tree_map(_data_of, (args, kwargs))
            return func(*data_args, **data_kwargs)
        step = _pending[0]
        try:
            with _recording(step):
                proxy_args, proxy_kwargs = _map(lambda item: _proxy_of(item, step), args, kwargs)
                result = dispatch(func, tuple(proxy_args), proxy_kwargs)
                return _lazy_of(result) if _flat(result) else pytree.tree_map(_lazy_of, result)
        except TraceError as error:
            return _run_eagerly(func, args, kwargs, error)


def _run_eagerly(func: Any, args: Any, kwargs: dict[str, Any], error: TraceError) -> Any:
    """A call no graph node can hold (a result shaped by data: ``nonzero``, ``x[mask]``): the
    pending step runs, PyTorch runs the call on the data, its tensors come back lazy. Not when
    it would write a lazy tensor or cut a gradient's path: then the error stands."""
    leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, LazyTensor)]
    name = api_name(func)
    differentiable = torch.is_grad_enabled() and any(map(_native_flag, leaves))
    in_place = name.endswith("_") and not name.endswith("__")
    if differentiable or in_place or not leaves:
        raise error
    _log.info("%s runs eagerly between steps: %s", name, error.message)
    counters.eager_calls += 1
    _sync(leaves, name)
    data_args, data_kwargs = pytree.tree_map(_data_of, (args, kwargs))
    result = func(*data_args, **data_kwargs)
    return pytree.tree_map(lambda t: LazyTensor(t) if _real(t) else t, result)


def _real(item: Any) -> bool:
    return isinstance(item, torch.Tensor) and not isinstance(item, LazyTensor)


def _recording(step: PendingStep) -> contextlib.AbstractContextManager[Any]:
    """The step's builder, made active unless it is already (a lowering's calls, a read)."""
    return contextlib.nullcontext() if active_builder() is step.builder else step.builder


def _flat(item: Any) -> bool:
    return not isinstance(item, list | tuple | dict)


def _map(fn: Any, args: Any, kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``pytree.tree_map`` over a call's arguments, without pytree for the usual flat call."""
    if all(map(_flat, args)) and all(map(_flat, kwargs.values())):
        return tuple(map(fn, args)), {key: fn(value) for key, value in kwargs.items()}
    return pytree.tree_map(fn, (tuple(args), kwargs))


def _native_flag(tensor: torch.Tensor) -> bool:
    with torch._C.DisableTorchFunctionSubclass():
        return bool(tensor.requires_grad)


def _proxy_of(item: Any, step: PendingStep) -> Any:
    return item._proxy_in(step) if isinstance(item, LazyTensor) else item


def _sync(items: list[Any], reason: str) -> None:
    """Compute the pending values of the lazy tensors among ``items``: only the work they
    depend on runs, and the step stays pending (``backward()`` may still follow)."""
    step = _pending[0]
    with _recording(step):
        waiting = [
            (item, item._proxy.current())  # type: ignore[union-attr]
            for item in items
            if isinstance(item, LazyTensor) and item._pending_work()
        ]
    if waiting:
        results = run_step(step, [value for _, value in waiting], reason, keep=True)
        for (tensor, _), data in zip(waiting, results, strict=True):
            tensor._data = data


def _data_of(item: Any) -> Any:
    return item._data if isinstance(item, LazyTensor) else item


def _lazy_of(item: Any) -> Any:
    """A proxy the frontend returned, as the lazy tensor that owns it (an in-place op's operand)
    or a new one."""
    if not isinstance(item, ProxyTensor):
        return item
    owner = getattr(item, "_lazy_owner", None)
    tensor = owner() if owner is not None else None
    if tensor is not None and tensor._proxy is item:
        return tensor
    return LazyTensor(None, item, requires_grad=item.current().type.requires_grad)


def _grad_attribute(name: str, tensor: LazyTensor, value: Any = None) -> Any:
    """``t.grad``: the gradient ``backward`` recorded (a lazy tensor), kept on the wrapper."""
    if name == "__get__":
        return tensor._lazy_grad
    if value is not None and not isinstance(value, LazyTensor):
        raise TypeError("the .grad of a lazy tensor must be a lazy tensor (kiln.lazy.to_lazy)")
    tensor._lazy_grad = value
    return None


def _backward(
    loss: LazyTensor,
    gradient: Any = None,
    retain_graph: bool | None = None,
    create_graph: bool = False,
    inputs: Any = None,
) -> None:
    """Record the reverse sweep from ``loss`` into the pending step's graph and accumulate each
    leaf's gradient into its ``.grad`` (a lazy value of the same step)."""
    step = _pending[0]
    if create_graph or inputs is not None:
        raise NotImplementedError("lazy backward() with create_graph or inputs")
    if loss._epoch != step.epoch or loss._proxy is None:
        raise KilnError(
            "backward() of a lazy tensor whose step already ran (mark_step came between the "
            "loss and its backward): the graph it came from is gone",
            user_location(),
        )
    leaves = [
        t for t in _live.values() if t._leaf and t._epoch == step.epoch and t._proxy is not None
    ]
    with _recording(step), torch.no_grad():
        seed = _proxy_of(gradient, step) if gradient is not None else None
        if seed is None:
            seed = dispatch(torch.ones_like, (loss._proxy,), {})
        grads = sweep(list(step.graph.nodes), {loss._proxy.current(): seed.current()})
    for leaf in leaves:
        assert leaf._proxy is not None
        grad = grads.get(leaf._proxy._initial)
        if grad is None:
            continue
        new = LazyTensor(None, ProxyTensor(grad))
        if leaf._lazy_grad is not None:  # (accumulated, as eager autograd does)
            with torch.no_grad():
                new = _lazy_of(torch.add(leaf._lazy_grad, new))
        leaf._lazy_grad = new


def mark_step() -> None:
    """Compile (or reuse, by structural hash) and run the pending step; every live lazy tensor
    it made or changed holds its new data afterwards."""
    step = _pending[0]
    bound = [t for t in _live.values() if t._epoch == step.epoch and t._proxy is not None]
    changed = [t for t in bound if t._pending_work()]
    with _recording(step):
        outputs = [t._proxy.current() for t in changed]  # type: ignore[union-attr]
    _pending[0] = PendingStep()
    for tensor in bound:
        tensor._proxy = None
    if not outputs:
        return
    for tensor, data in zip(changed, run_step(step, outputs, "mark_step"), strict=True):
        tensor._data = data


def to_lazy(target: Any) -> Any:
    """A tensor as a lazy tensor (an autograd leaf when it requires grad), or a module with its
    parameters and buffers replaced by lazy tensors (in place; returned)."""
    if isinstance(target, LazyTensor):
        return target
    if isinstance(target, torch.Tensor):
        return LazyTensor(
            target.detach(), requires_grad=target.requires_grad, leaf=target.requires_grad
        )
    if not isinstance(target, torch.nn.Module):
        raise TypeError(f"to_lazy expects a tensor or nn.Module, got {type(target).__name__}")
    moved: dict[int, LazyTensor] = {}
    for prefix, module in target.named_modules(remove_duplicate=False):
        for slot in (module._parameters, module._buffers):
            for attr, tensor in list(slot.items()):
                if tensor is None or isinstance(tensor, LazyTensor):
                    continue
                if id(tensor) not in moved:
                    lazy = to_lazy(tensor)
                    lazy._name = f"{prefix}_{attr}".strip("_").replace(".", "_")
                    moved[id(tensor)] = lazy
                slot[attr] = moved[id(tensor)]
    return target


def to_eager(tensor: LazyTensor) -> torch.Tensor:
    """The data of a lazy tensor, running the pending step first if it changes it."""
    _sync([tensor], "to_eager")
    assert tensor._data is not None
    return tensor._data
