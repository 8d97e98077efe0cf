"""Benchmarks: the harness (candidate vs baseline, interleaved in one run), several drafters against plain
(multi.py), peers (peers/: HF, llama.cpp), bench-serve (serve_load.py), the soak run, reports and plots, and the
offline EAGLE tree-shape tuner (eagle_shape.py).

May import: anything below cli/, serving/ included (bench-serve drives the real server). Nothing in the core
imports it."""
