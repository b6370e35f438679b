"""The architecture zoo: tiny random-init models from transformers configs, one entry each.

Each `Architecture` says how to build the torch module (returning one logits tensor, so the
ONNX graph has one float output), its example inputs and labels, the torch loss that matches
fblc's `cross_entropy` (mean over the labels that are not IGNORE_INDEX, classes on the last
axis of the logits), and which exporter writes the ONNX file: the dynamo exporter with
onnxscript's optimizer (`dynamo_opt`), without it (`dynamo`), or the legacy TorchScript one
(`legacy`), a third each, each family on at least two. Nothing is downloaded: every model is
made from its Config class under `torch.manual_seed`.

Models with BatchNorm are never on `dynamo_opt` (its optimizer fuses BN into the convs, and the
reference would have to be fused too, see models.fuse_conv_batch_norm), and their legacy export
keeps BN (`do_constant_folding=False`, which is what keeps the eval peephole from fusing it).
Every parameter that starts as a constant (LayerNorm's ones, zero biases) is given random
values: at equal values onnxscript merges initializers, and a zero bias hides gradient bugs.
"""

from __future__ import annotations

import inspect
import os
import types
import warnings
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import torch
import torch.nn.functional as F

from . import models
from .models import IGNORE_INDEX, ExportedModel

EXPORTERS = ("dynamo_opt", "dynamo", "legacy")
FAMILIES = ("decoder", "encoder", "enc-dec", "vision", "audio")

BATCH, SEQ, VOCAB, CLASSES, IMAGE = 2, 8, 64, 5, 32

Inputs = dict[str, np.ndarray]


@dataclass(frozen=True)
class Architecture:
    """One zoo entry. `build()` returns the eval-mode module and its inputs (ONNX input order)."""

    name: str
    family: str
    exporter: str
    build: Callable[[], tuple[torch.nn.Module, Inputs]]
    #: "causal": next-token labels from input_ids; "tokens": random labels per logits position;
    #: "class": one label per sample
    labels: str = "class"
    #: fblc --freeze regex for the tensors torch does not train (requires_grad=False)
    freeze: str | None = None
    #: the op another piece of work is adding; the test is xfail(strict) until it lands
    xfail_until: str | None = None
    #: regex of the torch parameters the exporter folds into constants (onnxscript's optimizer): they
    #: cannot train from this file; fblc must name each in its summary, and the rest must match torch
    folded: str | None = None
    #: legacy exporter only: its do_constant_folding (False where folding consumes parameters)
    fold: bool = True
    note: str = ""

    def __post_init__(self) -> None:
        assert self.family in FAMILIES and self.exporter in EXPORTERS, self


# --- building blocks -----------------------------------------------------------------------------


def randomize_constant_parameters(module: torch.nn.Module, seed: int) -> torch.nn.Module:
    """Perturb every parameter whose elements are all equal (norm weights, zero biases) in place."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            flat = param.reshape(-1)
            if flat.numel() > 0 and bool((flat == flat[0]).all()):
                param.add_(torch.empty_like(param).uniform_(-0.2, 0.2, generator=generator))
    return models.randomize_batch_norm(module, seed)


def logits_of(model: torch.nn.Module, input_names: tuple[str, ...], **fixed: Any) -> torch.nn.Module:
    """Make a transformers model take `input_names` positionally and return its logits only.

    As models.logits_only, for any number of inputs: the class is swapped for a subclass, so the
    exported initializers keep the model's torch names, and the forward's signature names the
    ONNX inputs.
    """
    base = type(model)

    def forward(self: torch.nn.Module, *tensors: torch.Tensor) -> torch.Tensor:
        return base.forward(self, **dict(zip(input_names, tensors)), **fixed).logits

    forward.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
        + [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in input_names])
    model.__class__ = type(base.__name__, (base,), {"forward": forward})
    return model


def _hf(model_class: str, config_class: str, input_names: tuple[str, ...], inputs: Callable[[], Inputs],
        fixed: dict[str, Any] | None = None, **config: Any) -> Callable[[], tuple[torch.nn.Module, Inputs]]:
    def build() -> tuple[torch.nn.Module, Inputs]:
        import transformers

        torch.manual_seed(0)
        model = getattr(transformers, model_class)(getattr(transformers, config_class)(**config))
        model = randomize_constant_parameters(model, seed=1)
        return logits_of(model, input_names, **(fixed or {})).eval(), inputs()

    return build


def _ids(seed: int = 0, low: int = 3) -> Inputs:
    rng = np.random.default_rng(seed)
    return {"input_ids": rng.integers(low, VOCAB, size=(BATCH, SEQ)).astype(np.int64)}


def _pixels(size: int = IMAGE) -> Inputs:
    rng = np.random.default_rng(1)
    return {"pixel_values": rng.standard_normal((BATCH, 3, size, size)).astype(np.float32)}


def _seq2seq() -> Inputs:
    rng = np.random.default_rng(2)
    return {"input_ids": rng.integers(3, VOCAB, size=(BATCH, SEQ)).astype(np.int64),
            "decoder_input_ids": rng.integers(3, VOCAB, size=(BATCH, SEQ)).astype(np.int64)}


def _waveform(samples: int = 800) -> Inputs:
    rng = np.random.default_rng(3)
    return {"input_values": rng.standard_normal((BATCH, samples)).astype(np.float32)}


def _mel() -> Inputs:
    rng = np.random.default_rng(4)
    return {"input_features": rng.standard_normal((BATCH, 8, 16)).astype(np.float32),
            "decoder_input_ids": rng.integers(3, VOCAB, size=(BATCH, SEQ)).astype(np.int64)}


def decoder(model: str, config: str, **kwargs: Any) -> Callable[[], tuple[torch.nn.Module, Inputs]]:
    return _hf(model if model.endswith("Model") else f"{model}ForCausalLM", f"{config}Config", ("input_ids",), _ids, {"use_cache": False},
               vocab_size=VOCAB, **kwargs)


def encoder(model: str, **kwargs: Any) -> Callable[[], tuple[torch.nn.Module, Inputs]]:
    return _hf(f"{model}ForSequenceClassification", f"{model}Config", ("input_ids",), _ids, None,
               vocab_size=VOCAB, num_labels=CLASSES, **kwargs)


def vision(model: str, config: str | None = None, post: Callable[[torch.nn.Module], None] | None = None,
           **kwargs: Any) -> Callable[[], tuple[torch.nn.Module, Inputs]]:
    build = _hf(f"{model}ForImageClassification", f"{config or model}Config", ("pixel_values",), _pixels, None,
                num_labels=CLASSES, **kwargs)
    if post is None:
        return build

    def patched() -> tuple[torch.nn.Module, Inputs]:
        module, inputs = build()
        post(module)
        return module, inputs

    return patched


def _uncached_attention_biases(module: torch.nn.Module) -> None:
    """LeViT in eval mode caches `attention_biases[:, idxs]`, which then exports as a constant
    and cannot train; index the table every call, as LeViT does in training mode."""
    def get_attention_biases(self: torch.nn.Module, device: torch.device) -> torch.Tensor:
        return self.attention_biases[:, self.attention_bias_idxs]

    for sub in module.modules():
        if hasattr(sub, "attention_bias_cache"):
            sub.get_attention_biases = types.MethodType(get_attention_biases, sub)


TRANSFORMER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
LLM = dict(TRANSFORMER, max_position_embeddings=32)
BERT_LIKE = dict(TRANSFORMER, max_position_embeddings=32, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
VIT_LIKE = dict(TRANSFORMER, image_size=IMAGE, patch_size=8)
SPEECH = dict(TRANSFORMER, conv_dim=(16, 16), conv_stride=(5, 4), conv_kernel=(10, 4), num_conv_pos_embeddings=8,
              num_conv_pos_embedding_groups=2, classifier_proj_size=8, mask_time_prob=0.0, vocab_size=VOCAB,
              num_labels=CLASSES)


# --- a MobileNetV3 (transformers has none): inverted residuals with SE and HardSwish -------------


class _SqueezeExcite(torch.nn.Module):
    def __init__(self, channels: int, squeezed: int) -> None:
        super().__init__()
        self.reduce = torch.nn.Conv2d(channels, squeezed, 1)
        self.expand = torch.nn.Conv2d(squeezed, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = F.adaptive_avg_pool2d(x, 1)
        return x * F.hardsigmoid(self.expand(F.relu(self.reduce(scale))))


class _InvertedResidual(torch.nn.Module):
    def __init__(self, c_in: int, expanded: int, c_out: int, stride: int, se: bool, hardswish: bool) -> None:
        super().__init__()
        act: type[torch.nn.Module] = torch.nn.Hardswish if hardswish else torch.nn.ReLU
        self.expand = torch.nn.Sequential(torch.nn.Conv2d(c_in, expanded, 1, bias=False),
                                          torch.nn.BatchNorm2d(expanded), act())
        self.depthwise = torch.nn.Sequential(torch.nn.Conv2d(expanded, expanded, 3, stride, 1, groups=expanded,
                                                             bias=False), torch.nn.BatchNorm2d(expanded), act())
        self.se = _SqueezeExcite(expanded, max(expanded // 4, 4)) if se else torch.nn.Identity()
        self.project = torch.nn.Sequential(torch.nn.Conv2d(expanded, c_out, 1, bias=False), torch.nn.BatchNorm2d(c_out))
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.project(self.se(self.depthwise(self.expand(x))))
        return x + out if self.residual else out


class TinyMobileNetV3(torch.nn.Module):
    """MobileNetV3-small in miniature: HardSwish stem, SE blocks, HardSwish head, 16-wide classifier."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, 2, 1, bias=False), torch.nn.BatchNorm2d(8),
                                        torch.nn.Hardswish())
        self.blocks = torch.nn.Sequential(_InvertedResidual(8, 16, 8, 1, se=True, hardswish=False),
                                          _InvertedResidual(8, 24, 16, 2, se=False, hardswish=True),
                                          _InvertedResidual(16, 32, 16, 1, se=True, hardswish=True))
        self.head = torch.nn.Sequential(torch.nn.Conv2d(16, 32, 1, bias=False), torch.nn.BatchNorm2d(32),
                                        torch.nn.Hardswish())
        self.classifier = torch.nn.Sequential(torch.nn.Linear(32, 16), torch.nn.Hardswish(),
                                              torch.nn.Linear(16, classes))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        features = self.head(self.blocks(self.stem(pixel_values)))
        return self.classifier(features.mean(dim=(2, 3)))


def _mobilenet_v3() -> tuple[torch.nn.Module, Inputs]:
    torch.manual_seed(0)
    return randomize_constant_parameters(TinyMobileNetV3(), seed=1).eval(), _pixels()


# --- a recurrent sensor model (transformers has none): human-activity recognition -----------------


class TinyActivityGRU(torch.nn.Module):
    """Inertial windows [B, 9 channels, T] -> a temporal conv, a 2-layer bidirectional GRU, the last step's
    state classified: the shape of on-device activity and keyword models."""

    def __init__(self, classes: int = CLASSES) -> None:
        super().__init__()
        self.conv = torch.nn.Conv1d(9, 12, 3, padding=1)
        self.gru = torch.nn.GRU(12, 8, num_layers=2, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(16, classes)

    def forward(self, input_values: torch.Tensor) -> torch.Tensor:
        features = F.relu(self.conv(input_values)).transpose(1, 2)
        sequence, _ = self.gru(features)
        return self.head(sequence[:, -1])


def _activity_gru() -> tuple[torch.nn.Module, Inputs]:
    torch.manual_seed(0)
    rng = np.random.default_rng(6)
    inputs = {"input_values": rng.standard_normal((BATCH, 9, 12)).astype(np.float32)}
    return randomize_constant_parameters(TinyActivityGRU(), seed=1).eval(), inputs


# --- the table -------------------------------------------------------------------------------------


ZOO: list[Architecture] = [
    # decoder LLMs: next-token prediction on [2, 8] ids
    Architecture("llama", "decoder", "dynamo_opt", decoder("Llama", "Llama", num_key_value_heads=1, **LLM), "causal"),
    Architecture("qwen2", "decoder", "dynamo_opt", decoder("Qwen2", "Qwen2", num_key_value_heads=1, **LLM), "causal"),
    Architecture("mistral", "decoder", "dynamo_opt",
                 decoder("Mistral", "Mistral", num_key_value_heads=1, sliding_window=None, **LLM), "causal"),
    Architecture("gemma", "decoder", "dynamo",
                 decoder("Gemma", "Gemma", num_key_value_heads=1, head_dim=8, **LLM), "causal"),
    Architecture("phi", "decoder", "dynamo_opt", decoder("Phi", "Phi", **LLM), "causal"),
    Architecture("gpt_neox", "decoder", "dynamo_opt", decoder("GPTNeoX", "GPTNeoX", **LLM), "causal"),
    Architecture("opt", "decoder", "legacy",
                 decoder("OPT", "OPT", hidden_size=16, num_hidden_layers=1, num_attention_heads=2, ffn_dim=32,
                         word_embed_proj_dim=16, max_position_embeddings=32, dropout=0.0), "causal"),
    Architecture("bloom", "decoder", "legacy", decoder("Bloom", "Bloom", hidden_size=16, n_layer=1, n_head=2),
                 "causal"),
    Architecture("falcon", "decoder", "dynamo_opt",
                 decoder("Falcon", "Falcon", hidden_size=16, num_hidden_layers=1, num_attention_heads=2), "causal"),
    Architecture("gpt2", "decoder", "dynamo",
                 decoder("GPT2LMHeadModel", "GPT2", n_embd=16, n_layer=1, n_head=2, n_positions=32,
                         bos_token_id=1, eos_token_id=2), "causal"),
    # encoders: sequence classification of [2, 8] ids
    Architecture("bert", "encoder", "dynamo_opt", encoder("Bert", **BERT_LIKE),
                 folded=r"^bert\.embeddings\.(position|token_type)_embeddings\.weight$",
                 note="onnxscript folds the embeddings it gathers at constant ids (positions, token types)"),
    Architecture("distilbert", "encoder", "dynamo",
                 encoder("DistilBert", dim=16, hidden_dim=32, n_layers=1, n_heads=2, max_position_embeddings=32)),
    Architecture("albert", "encoder", "legacy", encoder("Albert", embedding_size=8, **BERT_LIKE)),
    Architecture("electra", "encoder", "legacy", encoder("Electra", embedding_size=16, **BERT_LIKE)),
    Architecture("roberta", "encoder", "legacy", encoder("Roberta", **BERT_LIKE)),
    Architecture("fnet", "encoder", "dynamo",
                 encoder("FNet", hidden_size=16, num_hidden_layers=1, intermediate_size=32, max_position_embeddings=32,
                         hidden_dropout_prob=0.0),
                 note="Fourier token mixing: torch.fft.fftn over (sequence, hidden) exports as two DFTs (lower_dft)"),
    Architecture("deberta_v2", "encoder", "dynamo",
                 encoder("DebertaV2", relative_attention=True, position_buckets=8, max_relative_positions=16,
                         pos_att_type=["p2c", "c2p"], **BERT_LIKE)),
    # encoder-decoders: token labels for every decoder position
    Architecture("t5", "enc-dec", "legacy",
                 _hf("T5ForConditionalGeneration", "T5Config", ("input_ids", "decoder_input_ids"), _seq2seq, None,
                     vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, num_layers=1, num_heads=2,
                     relative_attention_num_buckets=8, dropout_rate=0.0), "tokens"),
    Architecture("bart", "enc-dec", "dynamo",
                 _hf("BartForConditionalGeneration", "BartConfig", ("input_ids", "decoder_input_ids"), _seq2seq, None,
                     vocab_size=VOCAB, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32,
                     dropout=0.0), "tokens"),
    # vision: image classification of [2, 3, 32, 32]
    Architecture("vit", "vision", "dynamo_opt", vision("ViT", **VIT_LIKE), folded=r"^vit\.embeddings\.cls_token$",
                 note="onnxscript folds the cls token it expands over the batch"),
    Architecture("deit", "vision", "legacy", vision("DeiT", **VIT_LIKE)),
    Architecture("dinov2", "vision", "dynamo", vision("Dinov2", **VIT_LIKE)),
    Architecture("swin", "vision", "legacy",
                 vision("Swin", image_size=IMAGE, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2],
                        window_size=4), fold=False,
                 note="legacy folding would consume the relative position bias table (indexed by constants)"),
    Architecture("convnext", "vision", "dynamo_opt",
                 vision("ConvNext", hidden_sizes=[16, 32], depths=[1, 1], num_stages=2)),
    Architecture("efficientnet", "vision", "dynamo",
                 vision("EfficientNet", image_size=IMAGE, width_coefficient=0.25, depth_coefficient=1.0,
                        in_channels=[32, 16], out_channels=[16, 32], kernel_sizes=[3, 3], strides=[1, 2],
                        num_block_repeats=[1, 1], expand_ratios=[1, 2], hidden_dim=320, depthwise_padding=[])),
    Architecture("regnet", "vision", "legacy",
                 vision("RegNet", embedding_size=8, hidden_sizes=[16, 32], depths=[1, 1], groups_width=8)),
    Architecture("mobilenet_v2", "vision", "dynamo", vision("MobileNetV2", image_size=IMAGE, depth_multiplier=0.35, finegrained_output=False)),
    Architecture("mobilenet_v3", "vision", "dynamo", _mobilenet_v3,
                 note="transformers has no MobileNetV3: a tiny torch module (SE, HardSwish, HardSigmoid)"),
    Architecture("mobilevit", "vision", "legacy",
                 vision("MobileViT", image_size=IMAGE, hidden_sizes=[16, 16, 16], neck_hidden_sizes=[8, 8, 8, 16, 16,
                        16, 32], num_attention_heads=2, patch_size=2, expand_ratio=2.0)),
    Architecture("levit", "vision", "dynamo",
                 vision("Levit", image_size=IMAGE, hidden_sizes=[16, 32], num_attention_heads=[2, 2], depths=[1, 1],
                        key_dim=[8, 8], drop_path_rate=0, mlp_ratio=[2, 2], attention_ratio=[2, 2],
                        down_ops=[["Subsample", 8, 2, 2, 2, 2]], post=_uncached_attention_biases),
                 note="eval-mode LeViT caches biases[:, idxs] (a constant in the export): indexed every call"),
    Architecture("segformer", "vision", "dynamo_opt",
                 vision("Segformer", num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                        patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2],
                        decoder_hidden_size=16)),
    Architecture("dpt", "vision", "dynamo",
                 _hf("DPTForSemanticSegmentation", "DPTConfig", ("pixel_values",), _pixels, None,
                     **dict(VIT_LIKE, num_hidden_layers=2), backbone_out_indices=[0, 1], neck_hidden_sizes=[8, 16], reassemble_factors=[2, 1],
                     fusion_hidden_size=16, num_labels=CLASSES, semantic_classifier_dropout=0.0,
                     use_auxiliary_head=False), "tokens",
                 note="segmentation: a ConvTranspose upsamples the neck; logits [B, C, H, W], a label per pixel"),
    Architecture("resnet", "vision", "legacy",
                 vision("ResNet", embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")),
    # audio: utterance classification of [2, 800] samples; Whisper: tokens from [2, 8, 16] mel features
    Architecture("wav2vec2", "audio", "legacy",
                 _hf("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config", ("input_values",), _waveform, None,
                     **SPEECH), fold=False,
                 note="legacy folding would consume weight_norm's g and v (the conv weight is computed from them)"),
    Architecture("hubert", "audio", "dynamo",
                 _hf("HubertForSequenceClassification", "HubertConfig", ("input_values",), _waveform, None, **SPEECH)),
    Architecture("whisper", "audio", "dynamo",
                 _hf("WhisperForConditionalGeneration", "WhisperConfig", ("input_features", "decoder_input_ids"), _mel,
                     None, vocab_size=VOCAB, num_mel_bins=8, max_source_positions=8, max_target_positions=16,
                     d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                     decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, dropout=0.0,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1),
                 "tokens", freeze=r"encoder\.embed_positions",
                 note="torch keeps the encoder's sinusoidal embed_positions frozen (requires_grad=False)"),
    Architecture("activity_gru", "audio", "legacy", _activity_gru, fold=False,
                 note="transformers has no recurrent model: a tiny Conv1d + bidirectional GRU (the ONNX GRU op; "
                      "folding would merge the torch weights into reordered constants)"),
]
BY_NAME = {a.name: a for a in ZOO}


# --- labels, loss, export ----------------------------------------------------------------------------


def _labels(arch: Architecture, inputs: Inputs, logits: torch.Tensor) -> np.ndarray:
    rng = np.random.default_rng(5)
    if arch.labels == "causal":
        ids = inputs["input_ids"]
        labels = np.full_like(ids, IGNORE_INDEX)
        labels[:, :-1] = ids[:, 1:]
        return labels
    axis = 1 if logits.ndim >= 4 else logits.ndim - 1  # fblc's cross_entropy: classes of [N, C, H, W] on axis 1
    labels = rng.integers(0, logits.shape[axis], size=logits.shape[:axis] + logits.shape[axis + 1:]).astype(np.int64)
    if arch.labels == "tokens":
        labels[0, -1] = IGNORE_INDEX  # one ignored position: the mean is over the others
    return labels


def cross_entropy_loss(inputs: Inputs, labels: np.ndarray) -> models.LossOf:
    """fblc's cross_entropy in torch: classes on the last axis ([N, C, H, W]: axis 1, as torch's own),
    IGNORE_INDEX labels not counted."""
    tensors = [torch.from_numpy(v) for v in inputs.values()]

    def loss_of(module: torch.nn.Module) -> torch.Tensor:
        logits = module(*tensors)
        if logits.ndim >= 4:
            return F.cross_entropy(logits, torch.from_numpy(labels), ignore_index=IGNORE_INDEX)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), torch.from_numpy(labels).reshape(-1),
                               ignore_index=IGNORE_INDEX)

    return loss_of


def _has_batch_norm(module: torch.nn.Module) -> bool:
    return any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in module.modules())


def export(module: torch.nn.Module, inputs: Inputs, exporter: str, path: str, fold: bool = True) -> None:
    """Write `module` on `inputs` to `path` with `exporter` (opset 18)."""
    args = tuple(torch.from_numpy(v) for v in inputs.values())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "legacy":
            torch.onnx.export(module, args, path, dynamo=False, opset_version=18, input_names=list(inputs),
                              output_names=["logits"], do_constant_folding=fold and not _has_batch_norm(module))
        else:
            program = torch.onnx.export(module, args, dynamo=True, optimize=exporter == "dynamo_opt",
                                        opset_version=18, verbose=False)
            program.save(path)


def build(arch: Architecture, directory: str) -> ExportedModel:
    """Construct, export and describe one zoo entry (the ONNX file lands in `directory`)."""
    module, inputs = arch.build()
    assert not (arch.exporter == "dynamo_opt" and _has_batch_norm(module)), \
        f"{arch.name}: the optimizer fuses BN into the convs; the reference would need the same fusion"
    with torch.no_grad():
        logits = module(*(torch.from_numpy(v) for v in inputs.values()))
    assert isinstance(logits, torch.Tensor) and logits.dtype == torch.float32, arch.name
    labels = _labels(arch, inputs, logits)
    path = os.path.join(directory, f"{arch.name}_{arch.exporter}.onnx")
    export(module, inputs, arch.exporter, path, arch.fold)
    return ExportedModel(arch.name, path, module, inputs, labels, cross_entropy_loss(inputs, labels))


#: the smallest model of each family, for the device steps
DEVICE = {"decoder": "gpt2", "encoder": "distilbert", "enc-dec": "bart", "vision": "resnet", "audio": "hubert"}
