"""How close a blend answers to full prefill, and what a calibration measured of it.

Modules: ``measures`` (first-token KL, teacher-forced NLL, repetition loops, rotated orders: pure
Python, shared by the engine, the benchmarks and calibration) and ``records`` (what ``ragcache
calibrate`` measured for an index, kept in its folder's ``calibration.json``, read by the pipeline
for ``ratio = "auto"``). The calibration run itself drives a pipeline, so it sits above it, at
:mod:`ragcache.calibrate`. Importing this package imports none of its modules.
"""
