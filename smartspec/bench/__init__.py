"""Benchmark helpers: the serving load generator (`smartspec bench serve`), workloads, summaries and plots, and
the box-speed probe. Not used by the engine or the serving application."""
