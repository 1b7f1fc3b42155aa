"""Kernels measured and not selected by any lowering: kept runnable for the bench that compares them, outside the
package and outside CI (`pytest bench/experiments` runs their checks). Why each is not selected: docs/kernels-log.md."""
