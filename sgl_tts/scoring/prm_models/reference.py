"""Transformers reference for the step-classifier PRM: what the SGLang class must reproduce.

Qwen2.5-Math-PRM: a Qwen2 decoder whose head, Linear(h, h) -> ReLU -> Linear(h, 2), is applied to the
last hidden state of every token; the reward of step i is softmax(head logits at the i-th step token)[1].
No SGLang import here, so the reference stays independent of the code it checks.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sgl_tts.scoring.prm_models.tiny import STEP_TOKEN


def score_head(hidden_size: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(hidden_size, hidden_size), nn.ReLU(), nn.Linear(hidden_size, 2))


class ReferencePRM:
    """The checkpoint in `model_dir` loaded into transformers' `Qwen2Model` plus the head, in fp32."""

    def __init__(self, model_dir: str | Path, step_token: str = STEP_TOKEN):
        self.tokenizer, self.backbone, weights = _load_backbone(model_dir)
        self.step_token_id = self.tokenizer.convert_tokens_to_ids(step_token)
        self.head = score_head(self.backbone.config.hidden_size).float().eval()
        self.head.load_state_dict(_strip(weights, "score."), strict=True)

    @torch.no_grad()
    def step_probabilities(self, text_or_ids: str | list[int]) -> torch.Tensor:
        """[num_steps, 2] class probabilities at each step token, in order."""
        ids = self.tokenizer.encode(text_or_ids) if isinstance(text_or_ids, str) else list(text_or_ids)
        input_ids = torch.tensor([ids])
        hidden = self.backbone(input_ids=input_ids).last_hidden_state[0]
        rows = (input_ids[0] == self.step_token_id).nonzero().flatten()
        return torch.softmax(self.head(hidden[rows]), dim=-1)

    def step_rewards(self, text_or_ids: str | list[int]) -> list[float]:
        return self.step_probabilities(text_or_ids)[:, 1].tolist()


def reference_step_rewards(model_dir: str | Path, text_or_ids: str | list[int]) -> list[float]:
    """P(step correct) at each step token of `text_or_ids`, computed with transformers."""
    return ReferencePRM(model_dir).step_rewards(text_or_ids)


def _load_backbone(model_dir: str | Path):
    """(tokenizer, the checkpoint's `Qwen2Model` in fp32, all its tensors by name)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    model_dir = Path(model_dir)
    weights = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        weights.update(load_file(str(file)))
    backbone = Qwen2Model(Qwen2Config.from_pretrained(model_dir)).float().eval()
    backbone.load_state_dict(_strip(weights, "model."), strict=True)
    return AutoTokenizer.from_pretrained(model_dir), backbone, weights


def _strip(weights: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name[len(prefix):]: tensor for name, tensor in weights.items() if name.startswith(prefix)}


class ReferenceValuePRM:
    """Skywork-o1-Open-PRM's reading in transformers: the checkpoint's `Qwen2Model` and its value head
    `v_head.summary` = Linear(h, 1), in fp32. Its input is the tokenizer's BOS, the question and a newline, then
    every line of the response tokenized on its own and followed by the newline token; the reward of a line
    is sigmoid(value) at its newline."""

    def __init__(self, model_dir: str | Path):
        self.tokenizer, self.backbone, weights = _load_backbone(model_dir)
        self.value = nn.Linear(self.backbone.config.hidden_size, 1).float().eval()
        self.value.load_state_dict(_strip(weights, "v_head.summary."), strict=True)

    def encode(self, question: str, response: str) -> tuple[list[int], list[int]]:
        """(input ids, the index of every line's newline token)."""
        encode = lambda text: self.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
        newline = encode("\n")[-1]
        ids = encode((self.tokenizer.bos_token or "") + question + "\n")
        flags = []
        for line in response.split("\n"):
            ids += (encode(line) if line else []) + [newline]
            flags.append(len(ids) - 1)
        return ids, flags

    @torch.no_grad()
    def line_rewards(self, question: str, response: str) -> list[float]:
        ids, flags = self.encode(question, response)
        hidden = self.backbone(input_ids=torch.tensor([ids])).last_hidden_state[0]
        return torch.sigmoid(self.value(hidden[flags]).squeeze(-1)).tolist()
