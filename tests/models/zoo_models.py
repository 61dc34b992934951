"""Tiny random-weight transformers for the training zoo (``test_transformer_zoo.py``).

Each ``ZooModel`` builds one ``transformers`` architecture from a config (2 layers, width 32-64,
a few heads, vocabulary 99, dropout and every other source of training-time randomness off) and
makes a batch for it at a given size (sequence length, image side or audio length). Batches
carry ``labels`` where the task head has a loss, so a step is ``model(**batch).loss``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

VOCAB = 99
BATCH = 2


@dataclass(frozen=True)
class ZooModel:
    """One architecture: how to build it and a batch of ``size``, and the sizes a test uses
    (steps at the first size, then one at the second where the architecture allows)."""

    family: str  # decoder, encoder, encoder-decoder, vision or speech
    build: Callable[[], nn.Module]
    batch: Callable[[int], dict[str, Any]]
    sizes: tuple[int, ...]


def _without_randomness(config: Any) -> Any:
    """Dropout, layer drop, drop path and SpecAugment masking off, in sub-configs too, so a
    training step is a deterministic function of weights and batch."""
    for key, value in config.to_dict().items():
        if isinstance(value, float) and "drop" in key:
            setattr(config, key, 0.0)
        if key.startswith("mask_") and key.endswith("_prob"):
            setattr(config, key, 0.0)
    for key in getattr(config, "sub_configs", {}):
        _without_randomness(getattr(config, key))
    return config


def _config(name: str, **settings: Any) -> Any:
    import transformers

    return _without_randomness(getattr(transformers, name)(**settings))


def _model(name: str, config: Any) -> nn.Module:
    import transformers

    return getattr(transformers, name)(config)


def _tokens(length: int, low: int = 3) -> torch.Tensor:
    """Ids above the special tokens (0-2), so no position is padding by accident."""
    return torch.randint(low, VOCAB, (BATCH, length))


def _language_model(length: int) -> dict[str, Any]:
    ids = _tokens(length)
    return {"input_ids": ids, "labels": ids}


def _masked_language_model(length: int) -> dict[str, Any]:
    ids = _tokens(length)
    labels = torch.full_like(ids, -100)
    labels[:, ::3] = _tokens(length)[:, ::3]  # a third of the positions carry a target
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _translation(length: int) -> dict[str, Any]:
    ids = _tokens(length)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": _tokens(length - 2)}


def _image(side: int) -> dict[str, Any]:
    return {
        "pixel_values": torch.randn(BATCH, 3, side, side),
        "labels": torch.randint(0, 3, (BATCH,)),
    }


def _image_resized(side: int) -> dict[str, Any]:
    """For patch embeddings with learned positions: other sides interpolate them."""
    return _image(side) | {"interpolate_pos_encoding": True}


def _decoder(name: str, config: str, **settings: Any) -> ZooModel:
    base = {"vocab_size": VOCAB, "use_cache": False}
    base |= {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
    return ZooModel(
        "decoder",
        lambda: _model(name, _config(config, **(base | settings))),
        _language_model,
        (8, 12),
    )


def _llama_like(config: str, name: str, **settings: Any) -> ZooModel:
    shape = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 64,
    }
    return _decoder(name, config, **(shape | settings))


DECODERS: dict[str, ZooModel] = {
    "gpt2": _decoder(
        "GPT2LMHeadModel", "GPT2Config", n_embd=32, n_layer=2, n_head=4, n_positions=64
    ),
    "gpt_neo": _decoder(
        "GPTNeoForCausalLM",
        "GPTNeoConfig",
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        attention_types=[[["global", "local"], 1]],
        window_size=4,
        max_position_embeddings=64,
    ),
    "gptj": _decoder(
        "GPTJForCausalLM",
        "GPTJConfig",
        n_embd=32,
        n_layer=2,
        n_head=4,
        rotary_dim=4,
        n_positions=64,
    ),
    "opt": _decoder(
        "OPTForCausalLM",
        "OPTConfig",
        hidden_size=32,
        ffn_dim=37,
        word_embed_proj_dim=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    ),
    "bloom": _decoder("BloomForCausalLM", "BloomConfig", hidden_size=32, n_layer=2, n_head=4),
    "gpt_neox": _decoder(
        "GPTNeoXForCausalLM",
        "GPTNeoXConfig",
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        rotary_pct=0.5,
        max_position_embeddings=64,
    ),
    "falcon": _decoder(
        "FalconForCausalLM",
        "FalconConfig",
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=64,
    ),
    "llama": _llama_like("LlamaConfig", "LlamaForCausalLM"),
    "mistral": _llama_like("MistralConfig", "MistralForCausalLM", sliding_window=4),
    "qwen2": _llama_like("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": _llama_like("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "gemma": _llama_like("GemmaConfig", "GemmaForCausalLM", head_dim=8),
    "gemma2": _llama_like(
        "Gemma2Config", "Gemma2ForCausalLM", head_dim=8, sliding_window=4, query_pre_attn_scalar=8
    ),
    "phi": _decoder(
        "PhiForCausalLM",
        "PhiConfig",
        hidden_size=32,
        intermediate_size=37,
        num_hidden_layers=2,
        num_attention_heads=4,
        partial_rotary_factor=0.5,
        max_position_embeddings=64,
    ),
}


def _encoder(name: str, config: str, **settings: Any) -> ZooModel:
    base = {"vocab_size": VOCAB, "max_position_embeddings": 64}
    return ZooModel(
        "encoder",
        lambda: _model(name, _config(config, **(base | settings))),
        _masked_language_model,
        (8, 12),
    )


_BERT_SHAPE = {
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 37,
}

ENCODERS: dict[str, ZooModel] = {
    "bert": _encoder("BertForMaskedLM", "BertConfig", **_BERT_SHAPE),
    "roberta": _encoder("RobertaForMaskedLM", "RobertaConfig", pad_token_id=1, **_BERT_SHAPE),
    "distilbert": _encoder(
        "DistilBertForMaskedLM", "DistilBertConfig", dim=32, n_layers=2, n_heads=4, hidden_dim=37
    ),
    "albert": _encoder("AlbertForMaskedLM", "AlbertConfig", embedding_size=16, **_BERT_SHAPE),
    "electra": _encoder("ElectraForMaskedLM", "ElectraConfig", embedding_size=16, **_BERT_SHAPE),
    "deberta": _encoder(
        "DebertaForMaskedLM",
        "DebertaConfig",
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
        max_relative_positions=16,
        **_BERT_SHAPE,
    ),
    "deberta_v2": _encoder(
        "DebertaV2ForMaskedLM",
        "DebertaV2Config",
        relative_attention=True,
        pos_att_type=["c2p", "p2c"],
        position_buckets=8,
        max_relative_positions=16,
        **_BERT_SHAPE,
    ),
    # MPNet's attention hard-codes 32 relative-position buckets: the config's must match.
    "mpnet": _encoder("MPNetForMaskedLM", "MPNetConfig", **_BERT_SHAPE),
}


def _seq2seq(name: str, config: str, **settings: Any) -> ZooModel:
    base = {"vocab_size": VOCAB, "pad_token_id": 1, "bos_token_id": 0}
    base |= {"eos_token_id": 2, "decoder_start_token_id": 2}
    return ZooModel(
        "encoder-decoder",
        lambda: _model(name, _config(config, **(base | settings))),
        _translation,
        (8, 12),
    )


_BART_SHAPE = {
    "d_model": 32,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 37,
    "decoder_ffn_dim": 37,
    "max_position_embeddings": 64,
    "use_cache": False,
}

ENCODER_DECODERS: dict[str, ZooModel] = {
    "t5": _seq2seq(
        "T5ForConditionalGeneration",
        "T5Config",
        pad_token_id=0,
        eos_token_id=1,
        decoder_start_token_id=0,
        d_model=32,
        d_kv=8,
        d_ff=37,
        num_layers=2,
        num_heads=4,
        relative_attention_num_buckets=8,
        relative_attention_max_distance=16,
        use_cache=False,
        # At factor 1, unscaled attention over random weights saturates its softmax: under
        # bfloat16 autocast eager's own SDPA and eager-attention runs then differ by up to 17x
        # in gradient error against float64, too chaotic for any comparison.
        initializer_factor=0.1,
    ),
    "bart": _seq2seq("BartForConditionalGeneration", "BartConfig", **_BART_SHAPE),
    "marian": _seq2seq("MarianMTModel", "MarianConfig", **_BART_SHAPE),
    "pegasus": _seq2seq("PegasusForConditionalGeneration", "PegasusConfig", **_BART_SHAPE),
}


def _vision(
    name: str, config: str, batch: Callable[[int], dict[str, Any]], **settings: Any
) -> ZooModel:
    base = {"num_labels": 3, "image_size": 16, "num_channels": 3}
    return ZooModel(
        "vision", lambda: _model(name, _config(config, **(base | settings))), batch, (16, 24)
    )


_VIT_SHAPE = _BERT_SHAPE | {"patch_size": 4}


def _deit() -> nn.Module:
    model = _vision("DeiTForImageClassification", "DeiTConfig", _image, **_VIT_SHAPE).build()
    # DeiT starts its class, distillation and position embeddings at zero: those tokens enter
    # the first LayerNorm with zero variance, where eps=1e-12 scales gradients by 1e6.
    embeddings = model.deit.embeddings
    for token in (embeddings.cls_token, embeddings.distillation_token):
        nn.init.normal_(token, std=0.02)
    nn.init.normal_(embeddings.position_embeddings, std=0.02)
    return model


def _clip() -> nn.Module:
    text = {
        "vocab_size": VOCAB,
        "max_position_embeddings": 16,
        "bos_token_id": 0,
        "eos_token_id": 2,
        "projection_dim": 16,
    }
    vision = {"image_size": 16, "patch_size": 4, "projection_dim": 16}
    config = _config(
        "CLIPConfig",
        text_config=_BERT_SHAPE | text,
        vision_config=_BERT_SHAPE | vision,
        projection_dim=16,
    )
    return _model("CLIPModel", config)


def _clip_batch(side: int) -> dict[str, Any]:
    ids = _tokens(8)
    ids[:, -1] = 2  # the text embedding is read at the end-of-text token
    return {
        "input_ids": ids,
        "pixel_values": torch.randn(BATCH, 3, side, side),
        "return_loss": True,
        "interpolate_pos_encoding": True,
    }


VISION: dict[str, ZooModel] = {
    "vit": _vision("ViTForImageClassification", "ViTConfig", _image_resized, **_VIT_SHAPE),
    "deit": ZooModel("vision", _deit, _image_resized, (16, 24)),
    "beit": _vision(
        "BeitForImageClassification",
        "BeitConfig",
        _image_resized,
        use_relative_position_bias=True,
        use_mean_pooling=True,
        **_VIT_SHAPE,
    ),
    "swin": _vision(
        "SwinForImageClassification",
        "SwinConfig",
        _image,
        image_size=16,
        patch_size=2,
        embed_dim=16,
        depths=[1, 1],
        num_heads=[2, 4],
        window_size=2,
    ),
    "convnext": _vision(
        "ConvNextForImageClassification",
        "ConvNextConfig",
        _image,
        patch_size=2,
        hidden_sizes=[16, 32],
        depths=[1, 1],
        num_stages=2,
    ),
    "clip": ZooModel("vision", _clip, _clip_batch, (16, 24)),
}


_SPEECH_SHAPE = _BERT_SHAPE | {
    "vocab_size": 12,
    "conv_dim": (16, 16),
    "conv_stride": (4, 2),
    "conv_kernel": (8, 4),
    "num_conv_pos_embeddings": 8,
    "num_conv_pos_embedding_groups": 4,
    "ctc_loss_reduction": "mean",
    "ctc_zero_infinity": True,
    "pad_token_id": 0,
}


def _ctc_batch(samples: int) -> dict[str, Any]:
    return {
        "input_values": torch.randn(BATCH, samples),
        "labels": torch.randint(1, 12, (BATCH, 4)),
    }


def _whisper() -> nn.Module:
    config = _config(
        "WhisperConfig",
        vocab_size=VOCAB,
        num_mel_bins=8,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_source_positions=16,
        max_target_positions=32,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        use_cache=False,
    )
    return _model("WhisperForConditionalGeneration", config)


def _whisper_batch(length: int) -> dict[str, Any]:
    # The encoder takes exactly 2 * max_source_positions frames; the decoder's length varies.
    return {"input_features": torch.randn(BATCH, 8, 32), "labels": _tokens(length)}


def _speech2text() -> nn.Module:
    config = _config(
        "Speech2TextConfig",
        vocab_size=VOCAB,
        d_model=32,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=37,
        decoder_ffn_dim=37,
        max_source_positions=64,
        max_target_positions=32,
        conv_channels=16,
        input_feat_per_channel=8,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
        use_cache=False,
    )
    return _model("Speech2TextForConditionalGeneration", config)


def _filterbank_batch(frames: int) -> dict[str, Any]:
    features = torch.randn(BATCH, frames, 8)
    return {
        "input_features": features,
        "attention_mask": torch.ones(BATCH, frames, dtype=torch.long),
        "labels": _tokens(frames // 4),
    }


SPEECH: dict[str, ZooModel] = {
    "speech2text": ZooModel("speech", _speech2text, _filterbank_batch, (24, 32)),
    "whisper": ZooModel("speech", _whisper, _whisper_batch, (6, 9)),
    "wav2vec2": ZooModel(
        "speech",
        lambda: _model("Wav2Vec2ForCTC", _config("Wav2Vec2Config", **_SPEECH_SHAPE)),
        _ctc_batch,
        (160, 240),
    ),
    "hubert": ZooModel(
        "speech",
        lambda: _model("HubertForCTC", _config("HubertConfig", **_SPEECH_SHAPE)),
        _ctc_batch,
        (160, 240),
    ),
}

ZOO: dict[str, ZooModel] = DECODERS | ENCODERS | ENCODER_DECODERS | VISION | SPEECH


def output_tensors(value: Any, path: str = "out") -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor in a model output (ModelOutputs, tuples of hidden states, nested outputs)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from output_tensors(item, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for index, item in enumerate(value):
            yield from output_tensors(item, f"{path}[{index}]")
