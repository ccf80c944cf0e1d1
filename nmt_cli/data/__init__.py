"""Binarized, memory-mapped training data and `nmt prepare`, which makes it (a model's tokenizer read for fine-
tuning). Imports the root modules, text and model."""
