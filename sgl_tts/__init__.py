"""sgl-tts: test-time scaling of LLM reasoning as SGLang programs."""

__version__ = "0.1.0"
