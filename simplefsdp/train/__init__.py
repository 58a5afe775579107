"""The trainer, the top of the package: the loop and its setup (``trainer``), the command
line (``__main__``), one optimizer step, checkpoints, metrics, console lines, watchdog,
preflight. Nothing else in the package imports it (docs/design.md)."""
