"""Inference of the zoo's tiny transformers (``zoo_models.py``) at four sizes, against eager.

Each test builds one model in eval mode and calls it under ``torch.no_grad()`` on fresh random
batches at four sizes (sequence length, image side or audio length): the zoo's two, then two
more. Every output tensor must match eager's (float32, rtol=atol=1e-4) and no frame may run
uncompiled. Under automatic dynamic the first call is static and the second recaptures with
the changed dims symbolic, so calls 3 and 4 add no capture; under ``dynamic=True`` every input
dim is symbolic from the first call, so no call after it adds one.

A row that fails because of a Kiln gap carries ``xfail`` (strict) with the cause.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from zoo_models import ZOO, output_tensors

import kiln
from kiln.backends.kiln import CompiledProgramRecord
from kiln.recording import recording

pytest.importorskip("transformers")

# Two sizes past the zoo's own, per model; the batch builders accept them all.
MORE_SIZES: dict[str, tuple[int, int]] = {
    "decoder": (10, 15),
    "encoder": (10, 15),
    "encoder-decoder": (10, 15),
    "vision": (20, 28),
    "speech": (0, 0),  # per model below
}
SPEECH_SIZES: dict[str, tuple[int, int]] = {
    "speech2text": (28, 40),
    "whisper": (7, 11),
    "wav2vec2": (200, 320),
    "hubert": (200, 320),
}

# The default run keeps one architecture of most families (about 40 s on 2 cores); the rest
# are slow (the whole file: about 2 minutes on 2 cores). wav2vec2 (speech, a convolution
# front end) runs by default: its wrong results at new lengths went unseen while it was slow.
FAST = {"gpt2", "llama", "bert", "t5", "vit", "wav2vec2"}

# name -> the Kiln gap that makes it fail today (strict xfail).
DEBERTA = (
    "modeling_deberta.py:124 torch.tensor(min(max(q.size(-2), k.size(-2)), 16)) specializes the "
    "length: kiln/ops/translations/factories.py:158 makes torch.tensor of a size a constant "
    "(its use as a slice bound, modeling_deberta.py:300, needs a Python int)"
)
BEIT = (
    "interpolate_pos_encoding specializes the side: the model calls int() on the relative "
    "position table's side (torch_int, transformers utils/generic.py:831, from "
    "modeling_beit.py:239), and the extern F.interpolate(..., size=(dim_size, dim_size)) at "
    "modeling_beit.py:258 specializes the side as a Python int"
)
XFAIL: dict[str, str] = {"deberta": DEBERTA, "beit": BEIT}
XFAIL_DYNAMIC: dict[str, str] = {"deberta": DEBERTA, "beit": BEIT}

# name -> a Python branch on a size in the model's own code: the sizes on its other side take
# one more capture (as under torch.compile), which the test allows once.
SIZE_BRANCHES: dict[str, str] = {
    # dynamic=True only: the first side is the config's, whose position embeddings need no
    # interpolation (modeling_vit.py:103, modeling_deit.py:108, modeling_clip.py:176).
    "vit": "num_patches == num_positions",
    "deit": "num_patches == num_positions",
    "clip": "num_patches == num_positions",
    # Sides 20 and 28 leave an odd stage-2 resolution: a crop after the window padding
    # (modeling_swin.py:563, `if pad_values[3] > 0 or pad_values[5] > 0`).
    "swin": "pad_values[3] > 0",
}


def _sizes(name: str) -> list[int]:
    zoo = ZOO[name]
    more = SPEECH_SIZES[name] if zoo.family == "speech" else MORE_SIZES[zoo.family]
    return [*zoo.sizes, *more]


def _params(xfails: dict[str, str]) -> list[Any]:
    params = []
    for name in ZOO:
        marks: list[Any] = [] if name in FAST else [pytest.mark.slow]
        if name in xfails:
            marks.append(pytest.mark.xfail(strict=True, reason=xfails[name]))
        params.append(pytest.param(name, marks=marks, id=name))
    return params


def _compare(label: str, got: Any, want: Any) -> None:
    mine, eager = dict(output_tensors(got)), dict(output_tensors(want))
    assert mine.keys() == eager.keys(), f"{label}: outputs {list(mine)} != eager's {list(eager)}"
    problems = []
    for path, expected in eager.items():
        actual = mine[path]
        if actual.shape != expected.shape or actual.dtype != expected.dtype:
            problems.append(f"{path}: kiln {actual.shape} {actual.dtype}, eager {expected.shape}")
        elif not torch.allclose(actual, expected, rtol=1e-4, atol=1e-4, equal_nan=True):
            difference = (actual.double() - expected.double()).abs().max()
            problems.append(f"{path}: max |diff| {difference:.3g}")
    assert not problems, f"{label}: {len(problems)} differ\n" + "\n".join(problems)


def _infer(name: str, dynamic: bool | None) -> list[int]:
    """Calls the compiled model at each size; the captures counted after each call."""
    kiln.reset()
    torch.manual_seed(0)
    model = ZOO[name].build().eval()
    compiled = kiln.compile(model, dynamic=dynamic)
    captures = []
    with torch.no_grad():
        for size in _sizes(name):
            batch = ZOO[name].batch(size)
            # Eager first: a classifier's first call with labels sets config.problem_type,
            # which a capture guards on.
            expected = model(**batch)
            _compare(f"size {size}", compiled(**batch), expected)
            captures.append(kiln.counters.captures)
    fallbacks = [str(record) for record in kiln.counters.fallbacks]
    assert fallbacks == [], "frames ran uncompiled:\n" + "\n".join(fallbacks)
    return captures


def _check_captures(name: str, captures: list[int], static_calls: int) -> None:
    """No capture after the first ``static_calls`` calls, or one for a size branch."""
    allowed = 1 if name in SIZE_BRANCHES else 0
    grown = captures[-1] - captures[static_calls - 1]
    assert grown <= allowed and captures[-1] == captures[-2], (
        f"captures after each size {captures}\n{kiln.explain()}"
    )


@pytest.mark.parametrize("name", _params(XFAIL))
def test_automatic_dynamic_inference(name: str) -> None:
    _check_captures(name, _infer(name, dynamic=None), static_calls=2)


@pytest.mark.parametrize("name", _params(XFAIL_DYNAMIC))
def test_dynamic_true_inference(name: str) -> None:
    _check_captures(name, _infer(name, dynamic=True), static_calls=1)


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_captures_at_most_three_graphs(cache: str) -> None:
    # transformers' generate() with ``model.forward`` compiled: the prefill, the first decode
    # step (static), then one symbolic entry for every longer cache. The dynamic cache grows
    # by ``cat``, whose result a compiled program returns in a layout of its choice: a cache
    # dense in another dim order must become symbolic too (it once recompiled per token).
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=96, n_positions=64)
    config.bos_token_id = config.eos_token_id = None  # (random weights: never stop early)
    model = GPT2LMHeadModel(config).eval()
    ids = torch.randint(0, 96, (2, 5))
    options: dict[str, Any] = {"max_new_tokens": 9, "do_sample": False, "pad_token_id": 0}
    options["attention_mask"] = torch.ones_like(ids)
    if cache == "static":
        options.update(cache_implementation="static", disable_compile=True)
    kiln.reset()
    with torch.no_grad(), recording(CompiledProgramRecord) as programs:
        want = model.generate(ids, **options)
        model.forward = kiln.compile(model.forward)
        got = model.generate(ids, **options)
        again = model.generate(ids, **options)
    assert torch.equal(got, want) and torch.equal(again, want)
    assert kiln.counters.captures <= (3 if cache == "dynamic" else 2), kiln.counters.recompiles
    assert kiln.counters.fallbacks == []
    # one program serves every longer cache (its kernels take the length): not one per token
    assert len(programs) <= 4, [p.sizes for p in programs]
