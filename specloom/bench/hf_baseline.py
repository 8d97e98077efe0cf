"""Moved: the HF baselines live in `specloom.bench.peers.hf` (`hf`, `hf-assisted`, `hf-lookup`)."""

from .peers.hf import HFPlain, load_hf_fp32  # noqa: F401
