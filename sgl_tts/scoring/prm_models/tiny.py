"""Tiny random-weight PRM checkpoints, built deterministically from a seed (for tests).

The folder holds what the real model's folder holds, at toy size: a Qwen2 config naming the architecture,
safetensors weights named as in the HF checkpoint (`model.*` backbone; the head: `score.0.*` / `score.2.*`
for Qwen2.5-Math-PRM's `Qwen2ForProcessRewardModel`, `v_head.summary.*` for Skywork-o1-Open-PRM's
`Qwen2ForPrmModel`) and a fast tokenizer with the ChatML tokens and the step token `<extra_0>`. The tokenizer is byte-level BPE without merges (one token per byte), so it
needs no training data and any text tokenizes.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

ARCHITECTURE = "Qwen2ForProcessRewardModel"
VALUE_ARCHITECTURE = "Qwen2ForPrmModel"
STEP_TOKEN = "<extra_0>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", STEP_TOKEN)


def build_tokenizer(out_dir: Path):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|endoftext|>", pad_token="<|endoftext|>",
        additional_special_tokens=list(SPECIAL_TOKENS[1:]),
    )
    tokenizer.save_pretrained(out_dir)
    return tokenizer


def build_tiny_prm(out_dir: str | Path, seed: int = 0, hidden_size: int = 64, num_layers: int = 2,
                   num_heads: int = 4, num_kv_heads: int = 2, value_head: bool = False) -> Path:
    """Write the checkpoint folder into `out_dir` (created if missing) and return it: Qwen2.5-Math-PRM's
    shape, or with `value_head` Skywork-o1-Open-PRM's."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2Model

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    vocab_size = -(-len(tokenizer) // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False, initializer_range=0.4,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
    )
    config.architectures = [VALUE_ARCHITECTURE if value_head else ARCHITECTURE]
    # Not in the real checkpoint's config: lets plain /encode requests read out at the step token.
    config.step_token_id = tokenizer.convert_tokens_to_ids(STEP_TOKEN)

    torch.manual_seed(seed)
    backbone = Qwen2Model(config).float()
    generator = torch.Generator().manual_seed(seed + 1)
    tensors = {}
    for name, param in backbone.state_dict().items():
        # HF init leaves biases at 0 and norm weights at 1; perturb them so their loading is tested too.
        if name.endswith("bias"):
            param = 0.1 * torch.randn(param.shape, generator=generator)
        elif name.endswith("norm.weight"):
            param = 1.0 + 0.1 * torch.randn(param.shape, generator=generator)
        tensors[f"model.{name}"] = param.detach().float().contiguous().clone()
    # Unit-variance layers give logits of order 1: step probabilities spread over (0, 1), so a wrong
    # readout position shows.
    heads = ({"v_head.summary": (1, hidden_size)} if value_head else
             {"score.0": (hidden_size, hidden_size), "score.2": (2, hidden_size)})
    for name, shape in heads.items():
        tensors[f"{name}.weight"] = torch.randn(shape, generator=generator) / hidden_size**0.5
        tensors[f"{name}.bias"] = 0.1 * torch.randn(shape[:1], generator=generator)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})

    config_dict = config.to_dict()
    config_dict["dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    return out
