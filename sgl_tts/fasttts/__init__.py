"""FastTTS beneath the DSL: the P/M/S switches, runtime settings and speculative beam extension."""
