"""How many examples each native property runs, by Hypothesis profile (conftest.py) and convention.

CI's default (cpu-interp): CPU_EXAMPLES per kind of property. The gpu profile: each (convention, property) the
count its zoo's planted bugs need on the device's draws (OWN_EXAMPLES), else the kind's count (PROFILE_EXAMPLES),
else the profile's own (100). ROPE_MAX_EXAMPLES, and the nightly profile, give every property the same count.
"""
from __future__ import annotations

import os

from hypothesis import settings

# Examples per property in the CI default (Triton's interpreter runs every kernel program after another): enough to
# draw every declared class of a convention over its properties together (test_domains.py proves it); the GPU
# profile (realistic shapes) and the nightly one are the certification.
CPU_EXAMPLES = {"forward": 10, "backward": 6, "invariant": 4, "determinism": 3}
CI_PROFILE = "cpu-interp"
# The gpu profile's count of a kind of property where a convention's zoo gives no evidence of its own: forward the
# profile's 100, backward 50, determinism and an invariant the floor of 10 (below; the zoos' determinism bugs are
# hf's and hf-deepseek-v3's, with counts of their own). On a device the run is bound by Triton's compiles (most
# examples are a new specialization), so each property takes what its bugs need (OWN_EXAMPLES).
PROFILE_EXAMPLES = {CI_PROFILE: CPU_EXAMPLES, "gpu": {"backward": 50, "invariant": 10, "determinism": 10}}
# A property's own count in one convention, in the gpu profile: 1.5 times the latest example at which any of the
# convention's planted bugs named for that property was caught, over the zoo's derandomized draws and 3 to 10
# random seeds' draws of the device's plans (`python -m tests.conformance.device_draws --seeds N`, on the CPU,
# 2026-11-29), rounded up to ten; at least 30 forward, 20 backward, 10 determinism examples.
# An invariant's count is what the planted bugs that no forward, backward or determinism property catches need:
# the 35 such (bug, invariant) pairs, each on the derandomized draws and 10 random seeds' (2026-11-29), by the same
# rule with a floor of 10; 19 of them are caught by example 2 to 6 on every seed (a bad input by example 2), the
# invariants below need more. An invariant whose bugs other properties catch first, or that names no bug, takes the
# floor. A bug caught late by forward on some seed, and on every seed within its count by an invariant named for it,
# sets that invariant's count, not forward's (te-qknorm's thd_positions_not_restarting); te-qknorm's cp_ignored and
# start_positions_ignored (forward's example 45 and 27 on the derandomized draws, their invariants' 4 and 5) are
# named for their invariants alone. The worst example is given beside each (docs/conformance.md, "The budget").
OWN_EXAMPLES = {"gpu": {
    ("deepseek-v4", "backward"): 70,  # worst 43
    ("deepseek-v4", "batch_rows_alone"): 20,  # worst 12
    ("deepseek-v4", "forward"): 40,  # worst 23
    ("flash", "backward"): 40,  # worst 25
    ("flash", "batch_rows_alone"): 20,  # worst 10
    ("flash", "forward"): 70,  # worst 42
    ("hf", "backward"): 20,  # worst 10
    ("hf", "batch_rows_alone"): 20,  # worst 12
    ("hf", "determinism"): 20,  # worst 12
    ("hf", "forward"): 80,  # worst 52
    ("hf", "tables_batch_broadcast"): 30,  # worst 15
    ("hf", "unsqueeze_transposed"): 30,  # worst 15
    ("hf-deepseek-v3", "backward"): 40,  # worst 23
    ("hf-deepseek-v3", "batch_rows_alone"): 30,  # worst 19
    ("hf-deepseek-v3", "determinism"): 30,  # worst 19
    ("hf-deepseek-v3", "forward"): 40,  # worst 25
    ("hf-glm", "backward"): 20,  # worst 4
    ("hf-glm", "forward"): 30,  # worst 10
    ("hf-mrope", "backward"): 20,  # worst 6
    ("hf-mrope", "batch_rows_alone"): 20,  # worst 8
    ("hf-mrope", "forward"): 60,  # worst 39
    ("hf-single", "backward"): 20,  # worst 4
    ("hf-single", "forward"): 40,  # worst 22
    ("hf-single", "heads_together"): 70,  # worst 43
    ("liger", "backward"): 20,  # worst 4
    ("liger", "forward"): 100,  # worst 66
    ("megatron-mla", "backward"): 20,  # worst 4
    ("megatron-mla", "batch_rows_alone"): 20,  # worst 10
    ("megatron-mla", "forward"): 160,  # worst 101
    ("megatron-mla-kv", "backward"): 20,  # worst 6
    ("megatron-mla-kv", "batch_rows_alone"): 20,  # worst 10
    ("megatron-mla-kv", "forward"): 30,  # worst 18
    ("meta", "backward"): 20,  # worst 6
    ("meta", "forward"): 70,  # worst 42
    ("mrope", "backward"): 20,  # worst 4
    ("mrope", "forward"): 100,  # worst 65
    ("qknorm", "backward"): 20,  # worst 4
    ("qknorm", "batch_rows_alone"): 20,  # worst 8
    ("qknorm", "forward"): 30,  # worst 8
    ("qknorm-cache", "backward"): 20,  # worst 6
    ("qknorm-cache", "forward"): 30,  # worst 12
    ("qwen3vl-mrope", "backward"): 20,  # worst 6
    ("qwen3vl-mrope", "batch_rows_alone"): 20,  # worst 8
    ("qwen3vl-mrope", "forward"): 30,  # worst 8
    ("sglang-cache", "forward"): 30,  # worst 12
    ("te", "backward"): 20,  # worst 8
    ("te", "batch_rows_alone"): 20,  # worst 12
    ("te", "deterministic"): 20,  # worst 8
    ("te", "forward"): 120,  # worst 81 (thd_start_positions_skip_empty, one of 20 seeds; caught on 6 % of draws)
    ("te", "layouts_agree"): 40,  # worst 26
    ("te-qknorm", "backward"): 20,  # worst 5
    ("te-qknorm", "forward"): 30,  # worst 9 (thd_positions_not_restarting's 21: thd_equals_per_sequence, worst 6)
    ("te-qkv", "backward"): 20,  # worst 2
    ("te-qkv", "forward"): 50,  # worst 28
    ("te-qkv", "q_k_agree"): 20,  # worst 8
    ("torchtitan-complex", "backward"): 20,  # worst 4
    ("torchtitan-complex", "forward"): 120,  # worst 75
    ("torchtitan-cossin", "backward"): 20,  # worst 4
    ("torchtitan-cossin", "forward"): 30,  # worst 12
    ("vllm", "forward"): 100,  # worst 61
    ("vllm-cache", "forward"): 50,  # worst 30
    ("vllm-mrope", "forward"): 160,  # worst 101
    ("vllm-qknorm", "forward"): 30,  # worst 10
}}


def current_profile() -> str:
    get = getattr(settings, "get_current_profile_name", None)
    return get() if get else getattr(settings, "_current_profile", "default")


def examples_for(prop: str, profile: str, env, key: tuple | None = None) -> int | None:
    """The examples a property of kind `prop` (forward, backward, determinism, invariant) runs: its own count for
    `key` (convention, property) in the profile (OWN_EXAMPLES), else the profile's count for `prop`
    (PROFILE_EXAMPLES), else None (the profile's own count); ROPE_MAX_EXAMPLES, where set, gives None (conftest.py
    registers it into the profile)."""
    if env.get("ROPE_MAX_EXAMPLES"):
        return None
    own = OWN_EXAMPLES.get(profile, {}).get(key)
    return own if own is not None else PROFILE_EXAMPLES.get(profile, {}).get(prop)


def budget(prop: str, key: tuple | None = None):
    """Hypothesis settings with the examples of `examples_for` in the run's profile (none where the profile's own)."""
    n = examples_for(prop, current_profile(), os.environ, key)
    return settings(max_examples=n) if n is not None else (lambda test: test)
