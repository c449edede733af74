"""Step-classifier PRMs served by SGLang through its external-model mechanism.

SGLang imports every module of the package named by `SGLANG_EXTERNAL_MODEL_PACKAGE` in the scheduler
process and registers each class listed in a module's `EntryClass` under its class name, which the
checkpoint's `config.json` names in `architectures`. A runtime serving such a model needs
`EXTERNAL_MODEL_ENV` in its environment and, in the embedding path, `--is-embedding` and `SERVER_ARGS`;
in the generation path (radix-cached, read through logprobs) it reads the classes from the logprobs of
tokens `INCORRECT_TOKEN` and `CORRECT_TOKEN` (see `qwen2_prm`).
Importing this package does not import SGLang.
"""

EXTERNAL_MODEL_ENV = {"SGLANG_EXTERNAL_MODEL_PACKAGE": "sgl_tts.scoring.prm_models"}
SERVER_ARGS = ("--disable-radix-cache", "--chunked-prefill-size", "-1")
INCORRECT_TOKEN, CORRECT_TOKEN = 0, 1
