"""One module per group of `python -m bench.kernels`: each builds its cases and records rows in bench.timing.ROWS."""
