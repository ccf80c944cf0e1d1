"""From a model to text: greedy, beam and sampled search, prefixes, n-gram bans, constraints, the torch-free text
pipeline, the translator, line streaming and scoring. Imports the root modules, text and model."""
