"""Benchmarks that print side-by-side ratios: the runtime against HF generate, the FastTTS ablation,
full vs incremental verifier scoring."""
