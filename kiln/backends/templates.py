"""``mode="max-autotune"``'s matmul templates: the library or a fused kernel, by measurement.

For each :class:`~kiln.schedule.templates.MatmulPair` of a program (a 16-bit product and the
pointwise kernel reading it) the backend builds a :class:`PairChoice`. Its launcher, called
where the kernel was with the product's operands appended (``kernel(*buffers, *operands,
[seed])``), is a :class:`~kiln.runtime.autotune.TunedLauncher` over:

- ``library``: the extern ran the product (cuBLAS) at its own step; the kernel runs as
  scheduled. Measured as both (the product into a fresh tensor, then the kernel).
- one ``template ...`` per tile shape (``kiln/codegen/triton_matmul.py``): the product and
  the kernel's own loop in one launch (the kernels combined into its launch, if any, in a
  second one).

They are timed at the first launch, on the real operands; once a template is chosen the
extern only allocates the result (the template writes it when later steps read it). Choices
are cached on disk like launch shapes (same key scheme: the pair's signature, sizes, device,
Triton), so a warm process builds the chosen candidate alone and measures nothing; each
choice is a :class:`~kiln.runtime.autotune.TuningRecord` that ``kiln.explain`` prints. Pairs
with the same signature share one choice and one build.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from kiln.codegen.signatures import kernel_signature
from kiln.codegen.triton_matmul import generate_matmul, matmul_configs
from kiln.codegen.wrapper import Launcher, extern_function
from kiln.config import logger
from kiln.runtime.autotune import TunedLauncher, TuningRecord, cache_key, read_choice
from kiln.runtime.triton_build import build_triton_kernels
from kiln.schedule.program import ExternCall, View, kernel_arguments
from kiln.schedule.templates import MatmulPair

_log = logger("autotune")

LIBRARY = "library"


@dataclass
class PairChoice:
    """One pair's runtime state: whether its extern computes the product (``library``) or only
    allocates it, and the launcher that replaces its kernel."""

    pair: MatmulPair
    template: bool = False
    launcher: Launcher | None = None
    externs: dict[int, Callable[..., list[torch.Tensor]]] = field(default_factory=dict)

    def chosen(self, label: str) -> None:
        self.template = label != LIBRARY


def build_pair_choices(
    pairs: list[MatmulPair],
    launchers: dict[str, Launcher],
    device: torch.device,
    records: list[TuningRecord],
    extern: Callable[[ExternCall], Callable[..., list[torch.Tensor]]] = extern_function,
) -> dict[str, PairChoice]:
    """A :class:`PairChoice` per pair's kernel name. ``launchers``: the program's kernels
    (and each pair's ``rest``); ``records`` receives each distinct pair's choice."""
    interpret = device.type != "cuda"
    shared: dict[str, PairChoice] = {}
    by_kernel: dict[str, PairChoice] = {}
    sources = []
    waiting: list[tuple[PairChoice, list[Any], TuningRecord]] = []
    for pair in pairs:
        identity = _identity(pair)
        if identity in shared:
            by_kernel[pair.kernel.name] = _alias(shared[identity], pair, extern)
            continue
        choice = PairChoice(pair)
        choice.externs[id(pair.extern)] = _paired_extern(choice, pair, extern(pair.extern))
        key = cache_key(identity, device, interpret)
        cached = read_choice(key)
        configs = matmul_configs(pair, interpret)
        count = len(configs) + 1  # (and the library)
        if cached is not None and cached.chosen in (LIBRARY, *(c.label for c in configs)):
            configs = [c for c in configs if c.label == cached.chosen]
            record = cached
            record.kernel, record.candidates = _name(pair), count
        else:
            record = TuningRecord(_name(pair), key, candidates=count)
        made = []
        for config in configs:
            try:
                made.append((config.label, generate_matmul(pair, config, interpret)))
            except Exception as error:  # (the kernel's loop has no template form)
                _log.info("no template for %s: %s", pair.kernel.name, error)
                break
        else:
            sources += [source for _, source in made]
            waiting.append((choice, made, record))
            records.append(record)
            shared[identity] = by_kernel[pair.kernel.name] = choice
            continue
        del choice.externs[id(pair.extern)]  # (the pair stays an extern and a kernel)
    built = iter(build_triton_kernels(sources, device) if sources else [])
    for choice, made, record in waiting:
        templates = [(label, next(built)) for label, _ in made]
        _launch(choice, templates, launchers, extern(choice.pair.extern), record)
    return by_kernel


def _launch(
    choice: PairChoice,
    templates: list[tuple[str, Any]],
    launchers: dict[str, Launcher],
    product: Callable[..., list[torch.Tensor]],
    record: TuningRecord,
) -> None:
    pair = choice.pair
    arguments = kernel_arguments(pair.kernel)
    count = len(arguments)
    operands = len(pair.operands)
    kernel = launchers[pair.kernel.name]
    result_at = [i for i, b in enumerate(arguments) if b is pair.result]
    head_at = [arguments.index(b) for b in kernel_arguments(pair.head)]
    rest = launchers[pair.rest.name] if pair.rest is not None else None
    rest_at = [arguments.index(b) for b in kernel_arguments(pair.rest)] if pair.rest else []
    head_seed = pair.head.seed() is not None
    rest_seed = pair.rest is not None and pair.rest.seed() is not None

    def library(*values: Any, seed: Any = None) -> None:
        kernel(*values[:count], *values[count + operands :], seed=seed)

    # the extern's own operands: the views (passed after the buffers) and any constant
    # between them (a convolution without bias: None)
    constants = pair.extern.operands
    views = [i for i, o in enumerate(constants) if isinstance(o, View)]
    passed = {i: count + j for j, i in enumerate(views)}

    def measured(*values: Any, seed: Any = None) -> None:
        given = [values[passed[i]] if i in passed else o for i, o in enumerate(constants)]
        fresh = product(*given)[0]
        buffers = [fresh if i in result_at else v for i, v in enumerate(values[:count])]
        kernel(*buffers, *values[count + operands :], seed=seed)

    def template_of(template: Any) -> Launcher:
        def run(*values: Any, seed: Any = None) -> None:
            drawn = values[count + operands :] or ((seed,) if seed is not None else ())
            head = [values[i] for i in head_at]
            template(*head, *values[count : count + operands], *(drawn if head_seed else ()))
            if rest is not None:
                rest(*[values[i] for i in rest_at], *(drawn if rest_seed else ()))

        return run

    candidates = [(LIBRARY, library), *((label, template_of(t)) for label, t in templates)]
    written = frozenset(range(len(pair.kernel.writes()))) | (
        frozenset(result_at) if pair.keeps_result else frozenset()
    )
    if record.cached:
        label, run = candidates[-1] if templates else candidates[0]
        choice.chosen(label)
        run.seed_as_tensor = True  # type: ignore[attr-defined]
        choice.launcher = run
        return
    choice.launcher = TunedLauncher(
        candidates, written, record, timed={LIBRARY: measured}, on_choice=choice.chosen
    )


def _alias(
    shared: PairChoice,
    pair: MatmulPair,
    extern: Callable[[ExternCall], Callable[..., list[torch.Tensor]]],
) -> PairChoice:
    """Another pair of the same signature: the shared choice, this pair's extern beside."""
    shared.externs[id(pair.extern)] = _paired_extern(shared, pair, extern(pair.extern))
    return shared


def _paired_extern(
    choice: PairChoice, pair: MatmulPair, library: Callable[..., list[torch.Tensor]]
) -> Callable[..., list[torch.Tensor]]:
    """The extern's step: the product, or once a template computes it, its memory only."""
    result = pair.result
    shape = tuple(int(n) for n in result.shape)
    strides = tuple(int(s) for s in result.strides)

    def run(*operands: Any) -> list[torch.Tensor]:
        if choice.template:
            device = operands[0].device  # (a convolution's last may be None: no bias)
            return [torch.empty_strided(shape, strides, dtype=result.dtype, device=device)]
        return library(*operands)

    return run


def _identity(pair: MatmulPair) -> str:
    """What a pair's choice depends on besides the machine and Triton: the library's speed
    comes with PyTorch's version (its cuBLAS and cuDNN)."""
    node = pair.extern.node
    operands = [(v.shape, v.strides, str(v.buffer.dtype)) for v in pair.operands]
    buffers = [(b.shape, b.strides, str(b.dtype)) for b in kernel_arguments(pair.kernel)]
    rest = kernel_signature(pair.rest) if pair.rest is not None else ""
    return (
        f"torch {torch.__version__} {torch.backends.cudnn.version()}\n"
        f"matmul {node.op.name} {node.attrs!r} {operands} keeps={pair.keeps_result}\n"
        f"{kernel_signature(pair.kernel)}\n{buffers}\n{rest}"
    )


def _name(pair: MatmulPair) -> str:
    return f"{pair.kernel.name} with {pair.extern.node.op.printed_name}"
