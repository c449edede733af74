"""The SGLang frontend backend the programs run on, and the prompt format.

`TTSEndpoint` is SGLang's `RuntimeEndpoint` plus two things the search layer needs: per-request fields
(scheduling metadata, priority) taken from the program state's `REQUEST_FIELDS` variable, and an error that
names the runtime when it stops answering.
"""

from __future__ import annotations

from typing import Any

from sglang.lang.backend.runtime_endpoint import RuntimeEndpoint

REQUEST_FIELDS = "_sgl_tts_request_fields"  # program-state variable: extra top-level fields for /generate

SYSTEM_PROMPT = (
    "Solve the math problem step by step. Put a blank line between steps. "
    "End with: The answer is $\\boxed{ANSWER}$."
)


class TTSEndpoint(RuntimeEndpoint):
    def __init__(self, runtime: Any):
        super().__init__(runtime.url)
        self.runtime = runtime

    def generate(self, s, sampling_params):
        """One /generate request for the state's text: RuntimeEndpoint's body plus our request fields."""
        from sglang.lang.global_config import global_config

        from sgl_tts.runtime.server import http_json, request_timeout

        self._handle_dtype_to_regex(sampling_params)
        body: dict[str, Any] = {
            "text": s.text_,
            "sampling_params": {
                "skip_special_tokens": global_config.skip_special_tokens_in_output,
                "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
                **sampling_params.to_srt_kwargs(),
            },
        }
        for item in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(sampling_params, item, None)
            if value is not None:
                body[item] = value
        body.update(s.variables.get(REQUEST_FIELDS) or {})
        try:
            answer = http_json(self.base_url + "/generate", body, timeout=request_timeout(self.runtime))
        except OSError as exc:
            self.runtime.check_alive()
            raise RuntimeError(f"generator runtime '{self.runtime.name}' at {self.base_url} failed: {exc}") from exc
        return answer["text"], answer["meta_info"]


def chat_prompt(tokenizer: Any, question: str, system: str = SYSTEM_PROMPT) -> str:
    """The prompt text for `question` in the model's chat format, ending where the answer begins."""
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system}\n\nQuestion: {question}\n\nAnswer:\n"
