"""The `nmt` command: one module per command group, shared flags, one-line errors and Ctrl-C. Imports every other
package; nothing imports it but __main__."""
