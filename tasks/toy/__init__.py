"""The toy engine used by the demo, examples, tests and benchmarks.

A batch-invariant integer MoE policy, keyed sampling, a tool environment and multi-turn
rollouts that stage through the capture gate. Not part of the verification ledger.
"""
