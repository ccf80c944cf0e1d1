"""The Transformer and what runs or stores it: the layers' kernels, precision, attention recording, checkpoint
files. Imports the root modules and text."""
