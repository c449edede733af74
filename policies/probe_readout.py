"""The probe PRM's per-token margin, computed inside the generator's own forward ($SGLTTS_PROBE_HEAD=<head file>).

The probe (sgl_tts/scoring/probe.py) scores a step from the residual stream x after `layer` decoder layers,
normalised by the model's final RMSNorm (weight g, epsilon ε), over the step's tokens:

    m_t   = (w ∘ g) · x_t / sqrt(mean(x_t²) + ε)        one number per token
    score = sigmoid(mean_{t in step} m_t + b)            (pooling "last": m at the step's last token)

A generator rank computes x_t for every token it computes anyway. With this hook the rank keeps m_t, one dot
product per token, where a verifier runtime would run the first `layer` layers again over every path. m_t is
taken at the entry of decoder layer `layer` (SGLang's capture of the updated residual there) and kept by the
token's KV slot, margin[slot] = m_t, written by the forward that writes the slot's KV. The radix cache hands a slot
on only for the same token after the same prefix, so a cached token's margin is its own, whichever request
computed it.

An extend (prefill) answers, for each request, the margins of all its positions: `meta_info[META_KEY][0]`
(SGLang's customized_info, a list per request of what each of its forwards returned). A decode step answers
nothing. The scorer sends a path's text asking one new token: its tokens are in the rank's radix cache, since the
rank wrote them, so a score costs the forward of the tokens the cache lacks (the last one, at least).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable

from policies import lean_decode

TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.forward"
META_KEY = "sgl_tts_probe_margins"  # meta_info key of the margins an extend returns


@dataclass(frozen=True)
class ReadoutHead:
    """What a rank needs of a probe head file (sgl_tts.scoring.probe.ProbeHead): its layer and weights."""

    layer: int
    weight: tuple[float, ...]

    @classmethod
    def load(cls, path: str) -> "ReadoutHead":
        try:
            with open(path) as f:
                data = json.load(f)
            return cls(layer=int(data["layer"]), weight=tuple(float(v) for v in data["weight"]))
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"probe head {path}: not a probe head file: {exc}") from exc


class MarginTable:
    """m_t of every KV slot a rank has computed, for one head on one model."""

    def __init__(self, head: ReadoutHead, norm_weight: Any, eps: float):
        import torch

        self.weight = torch.tensor(head.weight, dtype=torch.float32) * norm_weight.detach().float().cpu()
        self.eps = float(eps)
        self.margins = torch.zeros(0, dtype=torch.float32)

    def record(self, residual: Any, slots: Any) -> None:
        """Keep the margins of the tokens a forward computed (`residual`'s rows) at their KV `slots`."""
        import torch

        x = residual[: len(slots)].float()
        margins = (x @ self.weight) * torch.rsqrt(x.pow(2).mean(-1) + self.eps)
        highest = int(slots.max()) + 1 if len(slots) else 0
        if highest > len(self.margins):
            grown = torch.zeros(max(highest, 2 * len(self.margins)), dtype=torch.float32)
            grown[: len(self.margins)] = self.margins
            self.margins = grown
        self.margins[slots] = margins

    def read(self, slots: Any) -> list[float]:
        return self.margins[slots].tolist()


def install_capture(model: Any, head: ReadoutHead, table_for: Callable[[], MarginTable]) -> None:
    """Wrap decoder layer `head.layer` of `model` (a Llama-like SGLang model) to record the residual at its
    entry into the rank's table (`table_for()`), passing any capture SGLang asked for on."""
    layers = model.model.layers
    if not 1 <= head.layer < len(layers):
        raise ValueError(f"probe head layer {head.layer} is outside 1..{len(layers) - 1}: read inside the generator, "
                         f"a head needs a decoder layer after its own (the model has {len(layers)})")
    hidden = model.model.norm.weight.shape[-1]
    if len(head.weight) != hidden:
        raise ValueError(f"probe head has {len(head.weight)} weights, the generator's hidden size is {hidden}")
    layer = layers[head.layer]
    forward = layer.forward

    def forward_with_capture(positions: Any, hidden_states: Any, forward_batch: Any, capture_output: Any = None,
                             **kwargs: Any) -> Any:
        def capture(value: Any, owned: bool = False) -> None:
            table_for().record(value, forward_batch.out_cache_loc)
            if capture_output is not None:
                capture_output(value, owned=owned)

        return forward(positions, hidden_states, forward_batch, capture_output=capture, **kwargs)

    layer.forward = forward_with_capture
    # the same record where the lean decode step (policies/lean_decode.py) computes the layer without its forward
    setattr(layer, lean_decode.CAPTURE,
            lambda residual, forward_batch: table_for().record(residual, forward_batch.out_cache_loc))


def make_forward_hook(head_path: str) -> Callable[..., Any]:
    """An AROUND hook for `ModelRunner.forward(self, forward_batch, ...)`: at the rank's first forward it wraps the
    head's layer; after each extend it attaches every request's margins to the forward's output."""
    head = ReadoutHead.load(head_path)
    tables: dict[int, MarginTable] = {}  # id(model runner) -> its table

    def forward(original: Callable[..., Any], runner: Any, forward_batch: Any, *args: Any, **kwargs: Any) -> Any:
        if id(runner) not in tables:
            norm = runner.model.model.norm
            tables[id(runner)] = MarginTable(head, norm.weight, norm.variance_epsilon)
            install_capture(runner.model, head, lambda: tables[id(runner)])
        output = original(runner, forward_batch, *args, **kwargs)
        if forward_batch.forward_mode.is_extend() and forward_batch.batch_size > 0:
            table, req_to_token = tables[id(runner)], runner.req_to_token_pool.req_to_token
            margins = [table.read(req_to_token[row, :length])
                       for row, length in zip(forward_batch.req_pool_indices.tolist(),
                                              forward_batch.seq_lens.tolist())]
            logits = output.logits_output
            logits.customized_info = {**(logits.customized_info or {}), META_KEY: margins}
        return output

    return forward
