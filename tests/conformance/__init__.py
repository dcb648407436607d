"""The native conformance suite: every RoPE convention certified in its own signature.

Each convention (spec/) draws its own arguments over their whole domain, computes in float64 what the
convention defines from the inputs as given, and declares its side effects (what is written, what is
returned). The generic properties (test_native.py) and the convention's own invariants run against
whatever `--rope-impl` names. This package imports nothing from `rope`: what a valid call is, and what it
must return, is decided here, for every implementation alike.

Layout:
    accuracy.py      the accuracy models: float32 math with one rounding, or math in the output dtype
    pairing.py       rotary pairs (half-split, interleaved), the float64 rotation
    contract.py      snapshots of every buffer, the side-effect check
    tensors.py       strategies for tensors in any layout (views into NaN-padded buffers), angles, tables
    spec/            one module per convention: capabilities, declared domain, strategy, oracle, side effects
    spec/domains.py  the vocabulary of declared domains: classes per argument, what a capability switches off
    zoo/             a correct pure-PyTorch implementation and planted bugs per convention
    test_native.py   the generic properties (forward, backward, side effects, inverse, pair norms)
    test_zoo.py      the suite on itself: every planted bug caught by a named property
    test_domains.py  the suite on its own strategies: every declared class drawn within the CPU budget
    test_signatures.py  a target's callables against their conventions' SIGNATURE
"""
