"""The SGLang frontend backend every program runs on: request lineage tags, accounting, prompt format."""
