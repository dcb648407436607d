"""Planted bugs, per convention: pure-PyTorch implementations, each correct but for one realistic bug that
valid input exposes. `CORRECT` in each module is the bug-free one (it must pass every property); `BUGS` maps a
bug's name to (the function, the properties expected to catch it). test_zoo.py runs them through the suite:
    pytest --rope-impl hf:tests.conformance.zoo.hf:k_rotates_q tests/conformance    fails
"""
