"""`nmt train`: options, the update, the run loop, run state, torchrun, training curves, and `make gpu-check` with
its toy task. Imports the root modules, text, model, data and decode."""
