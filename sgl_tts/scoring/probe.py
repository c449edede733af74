"""A trained step classifier served by a stock SGLang Llama runtime with the radix cache on (kind `probe`).

The classifier is a linear head on a decoder's normalised hidden state h at layer L, read at the last token
of each step ("last") or averaged over the step's tokens ("mean"): P(step correct) = sigmoid(w·h + b).
It needs no model class of its own: the checkpoint is the base model cut after layer L (its final RMSNorm
kept), with an untied LM head whose row for the positive token is w and every other row 0. The logit of
the positive token minus that of the negative token is then w·h, and log-softmax keeps differences, so

    score = sigmoid(logprob(+) - logprob(-) + b),

read with `return_logprob` and `token_ids_logprob` as the logprob-tag PRMs are (`sgl_tts.scoring.prm`). A mean
of w·h over tokens is w·mean(h), so "mean" pooling folds the same way. `probe.json` in the checkpoint folder
carries b, the pooling and the two token ids.

The score of step k depends only on the prompt and steps 1..k, so StepScorer's memo supplies the scores
already given and the scorer asks for logprobs only from the first new step on: SGLang serves a cached
prefix up to `logprob_start_len` (docs/sglang.md), so in a search only the new step's tokens are computed.

Without a runtime of its own (`scorer.runtime` unset) the probe is read inside the generator's forward: the
session starts the generator with the head (`generator_with_probe`), every rank keeps the margin w·h of each token
it computes, by KV slot (policies/probe_readout.py), and the scorer sends each path's text to the generator with
one token to generate. The path's tokens are in the generator's radix cache, since it wrote them, so a score costs
the tokens the cache lacks instead of a second model's prefill of the path; the answer carries the margin of every
position, and a step's score is sigmoid(mean margin + b) as above. The path goes as one text, as the generator was
sent it (tokenized step by step, a path's ids can part from the generator's at a step boundary and the rest would
be computed again), and each step's tokens are those that begin inside it (`whole_text_spans`). Requests carry the
lineage tag of the program run they score (`sgl_tts.scoring.base.scoring_run`), so a generator of several
data-parallel ranks serves them on the rank whose cache holds the run.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from bisect import bisect_left
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Literal, Sequence

from policies.base import BeamTag, encode_rid
from policies.probe_readout import META_KEY
from sgl_tts import env_names
from sgl_tts.runtime.models import register_builtin_model
from sgl_tts.runtime.server import RuntimeConfig
from sgl_tts.scoring.base import ScoreCounts, ScorerError, StepScorer, scored_run
from sgl_tts.scoring.runtime_calls import post_to_runtime
from sgl_tts.scoring.scorer_config import ScorerConfig

Pooling = Literal["last", "mean"]
POOLINGS = ("last", "mean")
PROBE_FILE = "probe.json"  # in the checkpoint folder: what the scorer needs beyond the weights
HEADS_DIR = Path(__file__).parent / "heads"  # trained heads committed with the command that made them
POSITIVE_TOKEN, NEGATIVE_TOKEN = "+", "-"
PROBE_MODEL = "smollm2-135m-probe"  # built-in model name of the committed head's checkpoint
DEFAULT_HEAD = HEADS_DIR / f"{PROBE_MODEL}.json"
BUILT_MARKER = "sgl-tts-probe.json"  # written last: a folder without it is an interrupted build


@dataclass(frozen=True)
class ProbeHead:
    """A linear head on the normalised hidden state after `layer` decoder layers of `base_model`."""

    base_model: str  # a model name for sgl_tts.runtime.models.resolve_model
    layer: int  # 1..num_hidden_layers
    pooling: Pooling
    weight: tuple[float, ...]  # standardisation already folded in
    bias: float
    trained_by: str = ""  # the command that reproduces it
    metrics: dict[str, Any] | None = None  # held-out figures measured when it was trained

    def __post_init__(self) -> None:
        if self.pooling not in POOLINGS:
            raise ValueError(f"pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if self.layer < 1:
            raise ValueError(f"layer must be at least 1, got {self.layer}")
        if not self.weight or not all(math.isfinite(v) for v in self.weight) or not math.isfinite(self.bias):
            raise ValueError("weight must be a non-empty list of finite numbers and bias finite")

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "ProbeHead":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
            return cls(**{**data, "weight": tuple(float(v) for v in data["weight"])})
        except (OSError, ValueError, TypeError, KeyError) as exc:
            raise ValueError(f"{path}: not a probe head file: {exc}") from exc


def step_spans(tokenizer: Any, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of prompt + steps, each tokenized on its own, and each step's [start, end) token range.

    Tokenizing piece by piece keeps a path's ids a prefix of its extensions' ids (radix reuse) and step
    boundaries on token boundaries. Training and serving both lay out text with this function. An empty step
    (a generator that stopped at once) has an empty range: its score reads the text before it."""
    ids = list(tokenizer(prompt, add_special_tokens=False).input_ids)
    spans = []
    for step in steps:
        start = len(ids)
        ids += tokenizer(step, add_special_tokens=False).input_ids
        if len(ids) == 0:
            raise ValueError(f"step {len(spans)} is empty and nothing comes before it: no token to read it at")
        spans.append((start, len(ids)))
    return ids, spans


def whole_text_spans(tokenizer: Any, prompt: str, steps: Sequence[str]) -> tuple[list[int], list[tuple[int, int]]]:
    """Token ids of prompt + steps tokenized as one text, and each step's [start, end) token range: the tokens that
    begin inside the step's characters (a token across a boundary counts for the step it begins in)."""
    encoded = tokenizer(prompt + "".join(steps), add_special_tokens=False, return_offsets_mapping=True)
    ids, begins = list(encoded.input_ids), [begin for begin, _ in encoded.offset_mapping]
    if not ids:
        raise ValueError("the prompt and steps are empty: no token to read a step at")
    spans, end_char, end = [], len(prompt), bisect_left(begins, len(prompt))
    for step in steps:
        start, end_char = end, end_char + len(step)
        end = bisect_left(begins, end_char)
        spans.append((start, end))
    return ids, spans


def readout_positions(span: tuple[int, int], pooling: Pooling) -> range:
    """The token positions whose hidden states a step's score reads (an empty step: the token before it)."""
    start, end = span
    return range(end - 1, end) if pooling == "last" or start == end else range(start, end)


def build_probe_checkpoint(head: ProbeHead, base_dir: str | Path, out_dir: str | Path) -> Path:
    """Write the base model cut after `head.layer` layers with the head folded into its LM head."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out_dir)
    tokenizer = AutoTokenizer.from_pretrained(base_dir)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = model.config
    if config.model_type != "llama":
        raise ValueError(f"a probe checkpoint needs a Llama base model, {base_dir} is {config.model_type!r}")
    if not 1 <= head.layer <= config.num_hidden_layers:
        raise ValueError(f"head layer {head.layer} is outside 1..{config.num_hidden_layers} of {base_dir}")
    if len(head.weight) != config.hidden_size:
        raise ValueError(f"head has {len(head.weight)} weights, {base_dir} has hidden size {config.hidden_size}")
    positive, negative = (_single_token(tokenizer, t) for t in (POSITIVE_TOKEN, NEGATIVE_TOKEN))
    model.model.layers = model.model.layers[:head.layer]
    config.num_hidden_layers = head.layer
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:head.layer]
    config.tie_word_embeddings = False
    lm_head = torch.zeros(config.vocab_size, config.hidden_size)
    lm_head[positive] = torch.tensor(head.weight, dtype=torch.float32)
    model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)
    model.lm_head.weight = torch.nn.Parameter(lm_head)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / PROBE_FILE).write_text(json.dumps({
        "pooling": head.pooling, "bias": head.bias, "layer": head.layer,
        "positive_token_id": positive, "negative_token_id": negative,
    }, indent=1) + "\n")
    return out


def provision_probe_model(head_path: str | Path = DEFAULT_HEAD) -> Path:
    """The probe checkpoint of a head file, built once into the cache (a new head gets a new folder)."""
    from sgl_tts.runtime.models import models_dir, resolve_model

    head_path = Path(head_path)
    if not head_path.is_file():
        raise ValueError(f"probe head {head_path} is missing: train one with `sgl-tts train prm`")
    digest = hashlib.sha256(head_path.read_bytes()).hexdigest()
    folder = models_dir() / f"{PROBE_MODEL}-{digest[:12]}"
    if (folder / BUILT_MARKER).is_file():
        return folder
    head = ProbeHead.load(head_path)
    staging = folder.with_name(folder.name + ".partial")
    build_probe_checkpoint(head, resolve_model(head.base_model), staging)
    (staging / BUILT_MARKER).write_text(json.dumps({"head": head_path.name, "head_sha256": digest}) + "\n")
    if folder.exists():
        shutil.rmtree(folder)
    staging.rename(folder)
    return folder


def _single_token(tokenizer: Any, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) != 1:
        raise ValueError(f"{text!r} is {len(ids)} tokens for this tokenizer; the probe needs a single token")
    return ids[0]


def probe_head_path(config: ScorerConfig) -> Path:
    """The head file a probe read inside the generator uses: `scorer.probe_head` (a file, or a committed head's
    name), or the committed default head."""
    if config.probe_head is None:
        return DEFAULT_HEAD
    path = Path(config.probe_head)
    return path if path.suffix == ".json" or path.is_file() else HEADS_DIR / f"{config.probe_head}.json"


def generator_with_probe(generator: RuntimeConfig, scorer: ScorerConfig) -> RuntimeConfig:
    """The generator's runtime config, with the probe head its ranks compute margins of when the probe is read
    inside it (kind probe, no runtime of its own); otherwise `generator` as it is."""
    if scorer.kind != "probe" or scorer.runtime is not None:
        return generator
    path = probe_head_path(scorer)
    ProbeHead.load(path)  # a clear error now rather than in the generator's log
    return replace(generator, env={**generator.env, env_names.PROBE_HEAD: str(path.resolve())})


class ProbeScorer(StepScorer):
    """P(step correct) from a probe checkpoint (`build_probe_checkpoint`) on a plain SGLang runtime, or from the
    margins a generator started with the head computes (`generator_with_probe`)."""

    name = "probe"

    def __init__(self, config: ScorerConfig, runtime: Any, tokenizer: Any):
        super().__init__()
        self.runtime = runtime  # sgl_tts.runtime.server.Runtime (needs .url, .name, .model_path, .check_alive())
        self.tokenizer = tokenizer
        probe_file = Path(runtime.model_path) / PROBE_FILE
        self.in_generator = config.runtime is None and not probe_file.is_file()
        if self.in_generator:
            head = ProbeHead.load(probe_head_path(config))
            self.pooling, self.bias = head.pooling, head.bias
            return
        if not probe_file.is_file():
            raise ValueError(f"scorer 'probe': the scorer runtime's model {runtime.model_path} has no {PROBE_FILE}; "
                             "serve a probe checkpoint (model: smollm2-135m-probe, or `sgl-tts train prm`)")
        probe = json.loads(probe_file.read_text())
        self.pooling = probe["pooling"]
        self.bias = float(probe["bias"])
        self.positive_id, self.negative_id = int(probe["positive_token_id"]), int(probe["negative_token_id"])

    def score_new_steps(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        """One batched request for the new steps of every path (StepScorer's memo supplies the rest), after the
        prefix the paths share alone when several are read from their start (`_prefill_shared_prefix`)."""
        if self.in_generator:
            return self._read_generator(prompt, paths, first_new, counts)
        requests = [(index, *step_spans(self.tokenizer, prompt, steps), first)
                    for index, (steps, first) in enumerate(zip(paths, first_new))]
        self._prefill_shared_prefix([ids for _, ids, _, _ in requests], first_new, self._generate, counts)
        return self._request(requests, counts)

    def _read_generator(self, prompt: str, paths: Sequence[Sequence[str]], first_new: Sequence[int],
                        counts: ScoreCounts) -> list[list[float]]:
        """One batched request to the generator for every path's margins; the new steps' scores from them."""
        requests = [whole_text_spans(self.tokenizer, prompt, steps) for steps in paths]
        payload: dict[str, Any] = {"input_ids": [ids for ids, _ in requests],
                                   "sampling_params": {"max_new_tokens": 1, "temperature": 0.0}}
        run = scored_run()
        if run is not None:  # on the rank whose radix cache holds the run (policies/search_placement.py)
            payload["rid"] = [encode_rid(BeamTag(run, 0, 0)) for _ in requests]
        answers = self._generate(payload)
        answers = answers if isinstance(answers, list) else [answers]
        out = []
        for (ids, spans), first, answer in zip(requests, first_new, answers, strict=True):
            meta = answer["meta_info"]
            self._count_answer(meta, len(ids), counts)
            margins = (meta.get(META_KEY) or [None])[0]
            if margins is None or len(margins) != len(ids):
                raise ScorerError(f"the generator at {self.runtime.url} returned no probe margins for a path of "
                                  f"{len(ids)} tokens: it must run with {env_names.PROBE_HEAD} naming the head "
                                  "(a session of kind probe without a scorer runtime starts it so)")
            out.append([_sigmoid(sum(margins[p] for p in positions) / len(positions) + self.bias)
                        for positions in (readout_positions(span, self.pooling) for span in spans[first:])])
        return out

    def _generate(self, payload: dict[str, Any]) -> Any:
        return post_to_runtime(self.runtime, "/generate", payload)

    def _request(self, requests: list[tuple[int, list[int], list[tuple[int, int]], int]],
                 counts: ScoreCounts) -> list[list[float]]:
        starts = [readout_positions(spans[first], self.pooling)[0] for _, _, spans, first in requests]
        payload = {
            "input_ids": [ids for _, ids, _, _ in requests],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": starts,
            "token_ids_logprob": [self.positive_id, self.negative_id],
        }
        answers = self._generate(payload)
        answers = answers if isinstance(answers, list) else [answers]
        out = []
        for (_, ids, spans, first), start, answer in zip(requests, starts, answers, strict=True):
            meta = answer["meta_info"]
            self._count_answer(meta, len(ids), counts)
            scores = []
            for span in spans[first:]:
                # The distribution at position p is input entry p + 1 - start (entry j predicts token
                # start + j); at the last position it is the first output token's.
                margins = [self._margin(meta["input_token_ids_logprobs"][p + 1 - start] if p + 1 < len(ids)
                                        else meta["output_token_ids_logprobs"][0])
                           for p in readout_positions(span, self.pooling)]
                scores.append(_sigmoid(sum(margins) / len(margins) + self.bias))
            out.append(scores)
        return out

    def _margin(self, entry: Sequence[Sequence[Any]]) -> float:
        """logprob(+) - logprob(-) = w·h, from SGLang's [[logprob, id, text], ...]."""
        logprob = {int(item[1]): float(item[0]) for item in entry}
        return logprob[self.positive_id] - logprob[self.negative_id]


def _sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0


register_builtin_model(PROBE_MODEL, provision_probe_model)
