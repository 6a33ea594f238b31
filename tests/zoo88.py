"""Issue 27's zoo: 88 models people use, built from configs with random weights, never downloaded.

Each entry says how to build the model (torchvision with ``weights=None``, timm with
``pretrained=False``, Hugging Face with ``AutoModel.from_config`` on a small config), the
smallest inputs it accepts, and what is expected of it: the capture route that wins, whether
credit is offered (exact, checked against autograd) or refused (the error's message), and the
known defects a check of it still meets (``xfail``: check name to the defect).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

#: Sequence length of text inputs, and the vocabulary of the small language configs.
TOKENS, VOCAB = 6, 50


@dataclass(frozen=True)
class Entry:
    """One model of the zoo.

    ``inputs(dtype)`` gives ``(args, kwargs)`` with floating tensors in ``dtype``;
    ``route`` is the capture route expected to win; ``refused`` a regular expression the
    credit refusal's message matches (None: credit is offered and exact); ``dtype`` the one
    credit is checked in where the model runs in float64 (``why32`` says why it does not);
    ``warns`` a regular expression one of convert's warnings matches; ``xfail`` maps a check
    (``"convert"``, ``"output"``, ``"credit"``, ``"draw"``) to the known defect it meets.
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]
    route: str
    refused: str | None = None
    why32: str | None = None
    warns: str | None = None
    xfail: Mapping[str, str] = field(default_factory=dict)


def _image(size: int = 64, batch: int = 1) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda dtype: ((torch.rand(batch, 3, size, size, dtype=dtype),), {})


def _images(size: int) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
    """A detector's input: a list of one image."""
    return lambda dtype: (([torch.rand(3, size, size, dtype=dtype)],), {})


def _clip(frames: int = 4, size: int = 32) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
    return lambda dtype: ((torch.rand(1, 3, frames, size, size, dtype=dtype),), {})


def _pair(size: int) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
    """Optical flow: two images, and two refinement steps (RAFT's default is 12)."""
    return lambda dtype: ((torch.rand(1, 3, size, size, dtype=dtype),
                           torch.rand(1, 3, size, size, dtype=dtype)), {"num_flow_updates": 2})


def _ids(**extra: Callable[[torch.dtype], Any]) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
    """Token ids (one sequence of TOKENS), an attention mask, and further keyword inputs."""

    def inputs(dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
        ids = torch.randint(2, VOCAB, (1, TOKENS))
        return (ids,), {"attention_mask": torch.ones(1, TOKENS, dtype=torch.long),
                        **{k: make(dtype) for k, make in extra.items()}}

    return inputs


def _decoder_ids(dtype: torch.dtype) -> torch.Tensor:
    return torch.randint(2, VOCAB, (1, 4))


# --- torchvision ---------------------------------------------------------------------------------


def _tv(name: str, **options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import torchvision

        return torchvision.models.get_model(name, weights=None, **options)

    return build


def _tv_detector(name: str, **options: Any) -> Callable[[], nn.Module]:
    return _tv(name, weights_backbone=None, num_classes=3, **options)


def _mvit_v2_s(frames: int, size: int) -> Callable[[], nn.Module]:
    """torchvision's ``mvit_v2_s`` (its 16 blocks, as its builder sets them) for clips of
    ``frames`` frames of ``size`` pixels: the builder fixes 16 frames of 224 pixels."""

    def build() -> nn.Module:
        from torchvision.models.video.mvit import MSBlockConfig, MViT

        heads = [1, 2, 2, *[4] * 11, 8, 8]
        widths = [96, 96, 192, 192, *[384] * 11, 768, 768]
        stride_q = {1: [1, 2, 2], 3: [1, 2, 2], 14: [1, 2, 2]}
        stride_kv = [[1, 8, 8], [1, 4, 4], [1, 4, 4], *[[1, 2, 2]] * 11, [1, 1, 1], [1, 1, 1]]
        blocks = [MSBlockConfig(num_heads=heads[i], input_channels=widths[i], output_channels=widths[i + 1],
                                kernel_q=[3, 3, 3], kernel_kv=[3, 3, 3], stride_q=stride_q.get(i, [1, 1, 1]),
                                stride_kv=stride_kv[i]) for i in range(16)]
        return MViT(spatial_size=(size, size), temporal_size=frames, block_setting=blocks, residual_pool=True,
                    residual_with_cls_embed=False, rel_pos_embed=True, proj_after_attn=True,
                    stochastic_depth_prob=0.2, num_classes=5)

    return build


def _maxvit_t(size: int) -> Callable[[], nn.Module]:
    """torchvision's ``maxvit_t`` (its stages, widths and depths) for ``size`` pixels, with
    windows and grids of 2 by 2: the builder's 7 by 7 needs 224 pixels."""

    def build() -> nn.Module:
        from torchvision.models.maxvit import MaxVit

        return MaxVit(input_size=(size, size), stem_channels=64, partition_size=2,
                      block_channels=[64, 128, 256, 512], block_layers=[2, 2, 5, 2], head_dim=32,
                      stochastic_depth_prob=0.2, num_classes=5)

    return build


def _tv_entries() -> list[Entry]:
    make_fx = r"G was captured with make_fx .*level='module'"
    # Images of 64 pixels (torchvision resizes to 800 by default) and at most 3 detections
    # (100 or 200 by default): the post-processing after the heads repeats per detection.
    rcnn = {"min_size": 64, "max_size": 64, "box_detections_per_img": 3}
    one_stage = {"min_size": 64, "max_size": 64, "detections_per_img": 3}
    detectors = [
        ("fasterrcnn_mobilenet_v3_large_fpn", rcnn, "draft_export", None),
        ("retinanet_resnet50_fpn", one_stage, "make_fx", make_fx),
        ("fcos_resnet50_fpn", one_stage, "make_fx", make_fx),
        ("ssd300_vgg16", {"detections_per_img": 3}, "draft_export", None),  # resized to 300
        ("ssdlite320_mobilenet_v3_large", {"detections_per_img": 3}, "draft_export", None),  # to 320
        ("maskrcnn_resnet50_fpn", rcnn, "make_fx", make_fx),
        ("keypointrcnn_resnet50_fpn", rcnn, "draft_export", None),
    ]
    classify = [
        ("alexnet", {}), ("vgg11_bn", {}), ("resnet34", {}), ("resnext50_32x4d", {}),
        ("wide_resnet50_2", {}), ("squeezenet1_1", {}), ("densenet161", {}),
        ("googlenet", {"aux_logits": False, "init_weights": True}),
        ("inception_v3", {"aux_logits": False, "init_weights": True}),
        ("mobilenet_v2", {}), ("mobilenet_v3_large", {}), ("efficientnet_b1", {}),
        ("efficientnet_v2_s", {}), ("mnasnet0_5", {}), ("shufflenet_v2_x0_5", {}),
        ("regnet_x_400mf", {}), ("regnet_y_400mf", {}), ("convnext_tiny", {}),
        ("vit_b_32", {"image_size": 64}), ("swin_t", {}), ("swin_v2_t", {}),
        ("resnet101", {}), ("mobilenet_v3_small", {}),
    ]
    entries = [
        Entry(name, "torchvision classification", _tv(name, num_classes=5, **options),
              _image(96 if name == "inception_v3" else 64), "symbolic_trace")
        for name, options in classify
    ]
    entries.append(Entry("maxvit_t", "torchvision classification", _maxvit_t(64), _image(64), "symbolic_trace"))
    entries += [Entry(name, "torchvision detection", _tv_detector(name, **options), _images(64), route, refused)
                for name, options, route, refused in detectors]
    segment = {"weights_backbone": None, "num_classes": 3}
    entries += [
        Entry("fcn_resnet50", "torchvision segmentation", _tv("fcn_resnet50", aux_loss=False, **segment),
              _image(64), "symbolic_trace"),
        Entry("deeplabv3_mobilenet_v3_large", "torchvision segmentation",
              _tv("deeplabv3_mobilenet_v3_large", aux_loss=False, **segment), _image(64), "symbolic_trace"),
        Entry("lraspp_mobilenet_v3_large", "torchvision segmentation",
              _tv("lraspp_mobilenet_v3_large", **segment), _image(64), "symbolic_trace"),
    ]
    video = [("r3d_18", 4, 32), ("mc3_18", 4, 32), ("r2plus1d_18", 4, 32), ("s3d", 16, 224),
             ("swin3d_t", 4, 64)]
    entries += [Entry(name, "torchvision video", _tv(name, num_classes=5), _clip(frames, size), "symbolic_trace")
                for name, frames, size in video]
    entries.append(Entry("mvit_v2_s", "torchvision video", _mvit_v2_s(4, 32), _clip(4, 32), "symbolic_trace"))
    entries.append(Entry("raft_small", "torchvision optical flow", _tv("raft_small"), _pair(128), "export",
                         why32="RAFT builds its coordinate grids in float32 whatever the input's dtype"))
    return entries


# --- timm ----------------------------------------------------------------------------------------


def _timm(name: str, **options: Any) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import timm

        return timm.create_model(name, pretrained=False, num_classes=5, **options)

    return build


def _timm_entries() -> list[Entry]:
    families = [
        ("deit", "deit_tiny_distilled_patch16_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
        ("eva02", "eva02_tiny_patch14_224", {"img_size": 28, "depth": 2}, 28),
        ("cait", "cait_xxs24_224", {"img_size": 32, "patch_size": 8, "depth": 2}, 32),
        ("xcit", "xcit_nano_12_p16_224", {"img_size": 32, "depth": 2}, 32),
        ("levit", "levit_128s", {"img_size": 64}, 64),
        ("mixer", "mixer_s16_224", {"img_size": 32}, 32),
        ("poolformer", "poolformer_s12", {}, 64),
        ("convnextv2", "convnextv2_atto", {}, 64),
        ("edgenext", "edgenext_xx_small", {}, 64),
        ("ghostnet", "ghostnet_100", {}, 64),
        ("hrnet", "hrnet_w18_small", {}, 64),
        ("dla", "dla34", {}, 64),
        ("dpn", "dpn68", {}, 64),
        ("res2net", "res2net50_26w_4s", {}, 64),
        ("resnest", "resnest14d", {}, 64),
        ("repvgg", "repvgg_a0", {}, 64),
    ]
    return [Entry(name, f"timm {family}", _timm(name, **options), _image(size), "symbolic_trace",
                  xfail=TIMM_DEFECTS.get(name, {}))
            for family, name, options, size in families]


#: Known defects of fxnx that timm models meet: check to defect.
TIMM_DEFECTS: dict[str, dict[str, str]] = {}


# --- Hugging Face --------------------------------------------------------------------------------

#: Hugging Face models that change themselves on their first call, and what convert says.
SELF_CHANGING = {"big_bird": r"BigBirdModel changed itself while export captured it"}
#: Known defects of fxnx that Hugging Face models meet: check to defect.
HF_DEFECTS: dict[str, dict[str, str]] = {}

SMALL = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 32,
         "intermediate_size": 64}


def _hf(config: Callable[[Any], Any]) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        import transformers

        return transformers.AutoModel.from_config(config(transformers))

    return build


def _hf_entries() -> list[Entry]:
    text = SMALL | {"vocab_size": VOCAB}
    vision = SMALL | {"image_size": 32, "patch_size": 8, "num_channels": 3}

    def pixels(size: int) -> Callable[[torch.dtype], tuple[tuple[Any, ...], dict[str, Any]]]:
        return lambda dtype: ((torch.rand(1, 3, size, size, dtype=dtype),), {})

    def audio(dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(1, 400, dtype=dtype),), {}

    def whisper(dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randn(1, 16, 16, dtype=dtype),), {"decoder_input_ids": torch.randint(2, VOCAB, (1, 4))}

    def clip(dtype: torch.dtype) -> tuple[tuple[Any, ...], dict[str, Any]]:
        return (torch.randint(2, VOCAB, (1, TOKENS)),), {"pixel_values": torch.rand(1, 3, 32, 32, dtype=dtype)}

    entries = [
        ("bert", lambda t: t.BertConfig(**text), _ids()),
        ("gpt2", lambda t: t.GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=VOCAB), _ids()),
        ("t5", lambda t: t.T5Config(num_layers=2, num_decoder_layers=2, num_heads=2, d_model=32, d_kv=16,
                                    d_ff=64, vocab_size=VOCAB, decoder_start_token_id=0),
         _ids(decoder_input_ids=_decoder_ids)),
        ("llama", lambda t: t.LlamaConfig(**text, num_key_value_heads=1), _ids()),
        ("mistral", lambda t: t.MistralConfig(**text, num_key_value_heads=1), _ids()),
        ("mixtral", lambda t: t.MixtralConfig(**text, num_key_value_heads=1, num_local_experts=4,
                                              num_experts_per_tok=2, experts_implementation="batched_mm"),
         _ids()),
        ("falcon", lambda t: t.FalconConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32,
                                            vocab_size=VOCAB), _ids()),
        ("gpt_neox", lambda t: t.GPTNeoXConfig(**text), _ids()),
        ("mamba", lambda t: t.MambaConfig(num_hidden_layers=2, hidden_size=32, state_size=4, intermediate_size=64,
                                          vocab_size=VOCAB), lambda dtype: ((torch.randint(2, VOCAB, (1, TOKENS)),), {})),
        ("deberta_v2", lambda t: t.DebertaV2Config(**text), _ids()),
        ("xlnet", lambda t: t.XLNetConfig(n_layer=2, n_head=2, d_model=32, d_inner=64, vocab_size=VOCAB), _ids()),
        ("beit", lambda t: t.BeitConfig(**vision), pixels(32)),
        ("vit", lambda t: t.ViTConfig(**vision), pixels(32)),
        ("swin", lambda t: t.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                                        num_heads=[1, 2], window_size=4), pixels(32)),
        ("clip", lambda t: t.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16), clip),
        ("whisper", lambda t: t.WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, encoder_layers=1, decoder_layers=1,
                                              encoder_attention_heads=2, decoder_attention_heads=2, d_model=32,
                                              encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                                              max_target_positions=16, pad_token_id=1, bos_token_id=0,
                                              eos_token_id=0, decoder_start_token_id=0), whisper),
        ("wav2vec2", lambda t: t.Wav2Vec2Config(**SMALL, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                                num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                                                vocab_size=VOCAB), audio),
        ("hubert", lambda t: t.HubertConfig(**SMALL, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                                            num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=2,
                                            vocab_size=VOCAB), audio),
        ("big_bird", lambda t: t.BigBirdConfig(**text), _ids()),
        ("bart", lambda t: t.BartConfig(encoder_layers=1, decoder_layers=1, d_model=32, encoder_attention_heads=2,
                                        decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64,
                                        vocab_size=VOCAB), _ids(decoder_input_ids=_decoder_ids)),
        ("roberta", lambda t: t.RobertaConfig(**text, pad_token_id=1), _ids()),
        ("albert", lambda t: t.AlbertConfig(**text, embedding_size=16), _ids()),
        ("distilbert", lambda t: t.DistilBertConfig(n_layers=2, n_heads=2, dim=32, hidden_dim=64,
                                                    vocab_size=VOCAB), _ids()),
        ("electra", lambda t: t.ElectraConfig(**text, embedding_size=16), _ids()),
        ("opt", lambda t: t.OPTConfig(num_hidden_layers=2, num_attention_heads=2, hidden_size=32, ffn_dim=64,
                                      word_embed_proj_dim=32, vocab_size=VOCAB), _ids()),
        ("bloom", lambda t: t.BloomConfig(n_layer=2, n_head=2, hidden_size=32, vocab_size=VOCAB), _ids()),
        ("phi", lambda t: t.PhiConfig(**text), _ids()),
        ("qwen2", lambda t: t.Qwen2Config(**text, num_key_value_heads=1), _ids()),
        ("gemma", lambda t: t.GemmaConfig(**text, num_key_value_heads=1, head_dim=16), _ids()),
        ("convnext", lambda t: t.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1], num_stages=2), pixels(32)),
        ("segformer", lambda t: t.SegformerConfig(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                                  hidden_sizes=[16, 32], num_attention_heads=[1, 2],
                                                  patch_sizes=[7, 3], strides=[4, 2], mlp_ratios=[2, 2]),
         pixels(32)),
    ]
    return [Entry(f"hf-{name}", "Hugging Face", _hf(config), inputs, "export",
                  warns=SELF_CHANGING.get(name), xfail=HF_DEFECTS.get(name, {}))
            for name, config, inputs in entries]


ZOO: dict[str, Entry] = {e.name: e for e in (*_tv_entries(), *_timm_entries(), *_hf_entries())}


def reinitialise(model: nn.Module) -> nn.Module:
    """Give every parameter whose values are all zero (biases, norms, layer scales) uniform
    values, so that credit through it is not vacuous."""
    with torch.no_grad():
        for p in model.parameters():
            if not p.abs().sum():
                nn.init.uniform_(p, -0.5, 0.5)
    return model


def dtype_of(entry: Entry) -> torch.dtype:
    """The dtype the checks run in: float64 where credit is offered and the model runs in it."""
    return torch.float32 if entry.refused or entry.why32 else torch.float64


def built(entry: Entry) -> tuple[nn.Module, tuple[Any, ...], dict[str, Any]]:
    """The model in eval mode (zero parameters re-initialised) and its inputs, in :func:`dtype_of`."""
    dtype = dtype_of(entry)
    torch.manual_seed(0)
    model = reinitialise(entry.build().eval()).to(dtype)
    args, kwargs = entry.inputs(dtype)
    return model, args, kwargs
