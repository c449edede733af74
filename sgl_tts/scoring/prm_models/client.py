"""Client for a step-classifier PRM runtime (`Qwen2ForProcessRewardModel` behind SGLang's `/encode`).

Input format (Qwen2.5-Math-PRM's model card): a ChatML conversation of a system prompt, the question as
the user turn and the response as the assistant turn, where every step is followed directly by the step
token `<extra_0>`:

    <|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n
    <|im_start|>assistant\n{step 1}<extra_0>{step 2}<extra_0>...<|im_end|>\n

Exchange: the prompt is tokenized by the runtime (`POST /tokenize`), the client finds the step-token
positions and sends `POST /encode {"input_ids": [...], "token_indices_to_pool": [...]}`; each answer's
`"embedding"` is `[[P(incorrect), P(correct)], ...]`, one row per position. The reward of a step is
P(correct) at its step token.
"""

from __future__ import annotations

from typing import Sequence

from sgl_tts.runtime.server import http_json

STEP_TOKEN = "<extra_0>"
SYSTEM_PROMPT = "Please reason step by step, and put your final answer within \\boxed{}."


def build_prm_text(question: str, steps: Sequence[str], system: str = SYSTEM_PROMPT,
                   step_token: str = STEP_TOKEN) -> str:
    """The PRM prompt for `question` and `steps` (each stripped of surrounding whitespace, as in training)."""
    response = "".join(step.strip() + step_token for step in steps)
    return (f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{question}<|im_end|>\n"
            f"<|im_start|>assistant\n{response}<|im_end|>\n")


def classifier_step_rewards(url: str, text_or_ids: str | Sequence[int], step_token_id: int,
                            timeout: float = 600.0) -> list[float]:
    """P(correct) at each occurrence of `step_token_id` in the prompt, in order ([] when there is none)."""
    return batch_classifier_step_rewards(url, [text_or_ids], step_token_id, timeout)[0]


def batch_classifier_step_rewards(url: str, prompts: Sequence[str | Sequence[int]], step_token_id: int,
                                  timeout: float = 600.0) -> list[list[float]]:
    """`classifier_step_rewards` for many prompts in one `/encode` request (the runtime batches them)."""
    ids = _token_ids(url, prompts, timeout)
    readouts = [[pos for pos, token in enumerate(seq) if token == step_token_id] for seq in ids]
    rewards: list[list[float]] = [[] for _ in ids]
    # A request without positions would fall back to the model's default readout, so send none.
    todo = [k for k, positions in enumerate(readouts) if positions]
    if not todo:
        return rewards
    answers = http_json(url + "/encode", {
        "input_ids": [ids[k] for k in todo],
        "token_indices_to_pool": [readouts[k] for k in todo],
    }, timeout=timeout)
    for k, answer in zip(todo, answers, strict=True):
        probs = answer["embedding"]
        if len(probs) != len(readouts[k]):
            raise RuntimeError(f"PRM runtime at {url} returned {len(probs)} readouts for {len(readouts[k])} "
                               "step tokens: is it serving Qwen2ForProcessRewardModel?")
        rewards[k] = [row[1] for row in probs]
    return rewards


def prm_step_rewards(url: str, question: str, steps: Sequence[str], step_token_id: int,
                     system: str = SYSTEM_PROMPT, timeout: float = 600.0) -> list[float]:
    """One reward per step of `steps` answering `question`."""
    rewards = classifier_step_rewards(url, build_prm_text(question, steps, system), step_token_id, timeout)
    if len(rewards) != len(steps):
        raise ValueError(f"{len(steps)} steps gave {len(rewards)} step tokens: the question or a step "
                         f"contains the step token {STEP_TOKEN!r} itself")
    return rewards


def _token_ids(url: str, prompts: Sequence[str | Sequence[int]], timeout: float) -> list[list[int]]:
    texts = [p for p in prompts if isinstance(p, str)]
    tokenized = iter(http_json(url + "/tokenize", {"prompt": texts}, timeout=timeout)["tokens"] if texts else [])
    return [list(next(tokenized)) if isinstance(p, str) else [int(t) for t in p] for p in prompts]
