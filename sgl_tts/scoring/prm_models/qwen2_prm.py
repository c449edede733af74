"""`Qwen2ForProcessRewardModel` and `Qwen2ForPrmModel` for SGLang: Qwen2 step verifiers read out per step.

Qwen2.5-Math-PRM applies a 2-layer head, Linear(h, h) -> ReLU -> Linear(h, 2), to the last hidden
state of every token; the reward of step i is softmax(head logits at the i-th step token `<extra_0>`)[1].
The class runs in either of SGLang's two paths:

**Embedding path** (`--is-embedding`, `/encode`): for each request it returns a [num_readouts, 2] tensor of
class probabilities, which `/encode` answers as `"embedding": [[p0, p1], ...]`. Readout positions of a
request, in order of precedence:
1. `token_indices_to_pool` of the request (SGLang's multi-position readout field of `/encode`): positions
   in the full prompt. `sgl_tts.scoring.prm_models.client` sends the positions of the step token.
2. every occurrence of `config.step_token_id`, when the config names it (the tiny test checkpoint does;
   for the real checkpoint add `--json-model-override-args '{"step_token_id": 151651}'`).
3. otherwise the last token, a single whole-response score.
Positions are full-prompt coordinates, so the runtime must prefill each request whole: the class refuses
to start without `--disable-radix-cache` and `--chunked-prefill-size -1` (a step token in a cached prefix
or an earlier chunk would be silently skipped), the same rule SGLang applies to its own multi-position
scoring. The embedding path has no `logprob_start_len` to cap the prefix match at, so it cannot use the
radix cache.

`Qwen2ForPrmModel` (Skywork-o1-Open-PRM) has a value head instead, `v_head.summary` = Linear(h, 1), and
P(step correct) = sigmoid(value) at the newline that ends each step. Its two class logits are (0, value),
so softmax gives the same P(correct) and both paths below serve it unchanged.

**Generation path** (no `--is-embedding`, `/generate` with logprobs): the head is folded into the LM head.
The head's two logits (l0, l1) at every token, with a constant 1, are the "hidden state" [l0, l1, 1] given
to SGLang's logits processor with a [vocab, 3] LM head whose row 0 reads l0, row 1 reads l1 and every other
row is -1e4 (exp(-1e4) is 0 in fp32). Then log P(token 1) - log P(token 0) = l1 - l0 at every position, so
P(correct) = sigmoid(l1 - l0) is read from `token_ids_logprob=[0, 1]` at the step token, through the same
logprob path as the logprob-tag PRMs: with the radix cache on, chunked prefill on, and cached prefix
tokens served up to `logprob_start_len` (sgl_tts.scoring.prm.ClassifierPRMScorer).
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
from torch import nn
from transformers import Qwen2Config

from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.pooler import EmbeddingPoolerOutput
from sglang.srt.layers.quantization.base_config import QuantizationConfig
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.qwen2 import Qwen2Model
from sglang.srt.runtime_context import get_memory, get_model, get_schedule
from sglang.srt.utils import add_prefix

from sgl_tts.scoring.prm_models import CORRECT_TOKEN, INCORRECT_TOKEN

_ABSENT_LOGIT = -1e4  # every other token's logit; exp(-1e4) underflows to 0 in fp32, bf16 and fp16

# SGLang fuses q/k/v and gate/up into one parameter each: (fused name, checkpoint name, shard id).
_STACKED_PARAMS = (
    ("qkv_proj", "q_proj", "q"),
    ("qkv_proj", "k_proj", "k"),
    ("qkv_proj", "v_proj", "v"),
    ("gate_up_proj", "gate_proj", 0),
    ("gate_up_proj", "up_proj", 1),
)


class Qwen2ForProcessRewardModel(nn.Module):
    def __init__(self, config: Qwen2Config, quant_config: Optional[QuantizationConfig] = None,
                 prefix: str = "") -> None:
        super().__init__()
        _check_server_args()
        self.config = config
        self.model = Qwen2Model(config, quant_config=quant_config, prefix=add_prefix("model", prefix))
        self.score = nn.Sequential(
            nn.Linear(config.hidden_size, config.hidden_size), nn.ReLU(), nn.Linear(config.hidden_size, 2)
        )
        self.step_token_id = getattr(config, "step_token_id", None)
        if not get_model().is_embedding:
            self.logits_processor = LogitsProcessor(config)
            self.folded_head = FoldedHead(config.vocab_size)

    @torch.no_grad()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch,
                input_embeds: Optional[torch.Tensor] = None, get_embedding: bool = False):
        hidden_states = self.model(input_ids, positions, forward_batch, input_embeds)
        if not get_embedding:
            class_logits = self.class_logits(hidden_states).float()
            features = torch.cat([class_logits, torch.ones_like(class_logits[:, :1])], dim=-1)
            return self.logits_processor(input_ids, features.to(hidden_states.dtype), self.folded_head, forward_batch)
        rows = self._readout_rows(input_ids, forward_batch)
        flat = torch.cat(rows).to(hidden_states.device)
        probs = torch.softmax(self.class_logits(hidden_states[flat]).float(), dim=-1)
        return EmbeddingPoolerOutput(embeddings=list(probs.split([len(r) for r in rows])))

    def class_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[tokens, 2] logits of (incorrect, correct) at every token."""
        return self.score(hidden_states)

    def _readout_rows(self, input_ids: torch.Tensor, forward_batch: ForwardBatch) -> list[torch.Tensor]:
        """Per request, the rows of the flattened batch to read out (int64, on CPU)."""
        rows, start = [], 0
        requested = forward_batch.token_indices_to_pool
        for i, length in enumerate(forward_batch.extend_seq_lens_cpu):
            if requested is not None:
                local = requested[i].to(torch.int64)
            elif self.step_token_id is not None:
                local = (input_ids[start:start + length] == self.step_token_id).nonzero().flatten().cpu()
            else:
                local = torch.tensor([length - 1], dtype=torch.int64)
            rows.append(local + start)
            start += length
        return rows

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Load HF names (`model.*` and the head's); any tensor or parameter left over is an error."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            if name.startswith("lm_head.") or "rotary_emb." in name:
                continue
            for fused, part, shard in _STACKED_PARAMS:
                if f".{part}." in name:
                    target = name.replace(f".{part}.", f".{fused}.")
                    params[target].weight_loader(params[target], tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
                getattr(params[target], "weight_loader", default_weight_loader)(params[target], tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint has no tensor for parameters {missing}")
        return loaded


class Qwen2ForPrmModel(Qwen2ForProcessRewardModel):
    """Skywork-o1-Open-PRM: the Qwen2 backbone with a value head, `v_head.summary` = Linear(h, 1)."""

    def __init__(self, config: Qwen2Config, quant_config: Optional[QuantizationConfig] = None,
                 prefix: str = "") -> None:
        super().__init__(config, quant_config, prefix)
        del self.score
        self.v_head = nn.Module()
        self.v_head.summary = nn.Linear(config.hidden_size, 1)

    def class_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        value = self.v_head.summary(hidden_states)
        return torch.cat([torch.zeros_like(value), value], dim=-1)  # softmax(0, v)[1] = sigmoid(v)


class FoldedHead(nn.Module):
    """A [vocab, 3] LM head over the features [l0, l1, 1]: token 0 gets l0, token 1 gets l1, the rest -1e4."""

    def __init__(self, vocab_size: int) -> None:
        super().__init__()
        weight = torch.zeros(vocab_size, 3)
        weight[INCORRECT_TOKEN, 0] = weight[CORRECT_TOKEN, 1] = 1.0
        weight[2:, 2] = _ABSENT_LOGIT
        self.register_buffer("weight", weight)  # not a checkpoint tensor: a buffer, not a parameter


def _check_server_args() -> None:
    if not get_model().is_embedding:
        return  # generation path: the logprob path handles cached prefixes and chunks itself
    problems = []
    if not get_memory().disable_radix_cache:
        problems.append("--disable-radix-cache (a step token in a cached prefix would not be read out)")
    chunked = get_schedule().chunked_prefill_size
    if chunked is not None and chunked > 0:
        problems.append(f"--chunked-prefill-size -1, not {chunked} (a step token in an earlier chunk "
                        "would not be read out)")
    if problems:
        raise ValueError("Qwen2ForProcessRewardModel needs " + "; ".join(problems))


EntryClass = [Qwen2ForProcessRewardModel, Qwen2ForPrmModel]
