"""Measurement output, one room for it: metrics of results, statistics, tables, plots and summaries, used by
`sgl-tts run`, `sgl-tts eval`, the benchmarks and the RSD sweep."""
