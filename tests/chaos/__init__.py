"""The chaos scenarios and what they share (tests/integration/test_chaos.py runs them CI-sized, bench/chaos.py long):
`scenarios` (R1-R6), `chaoskit` (deterministic prompts and KV, the checking `Worker` actor), `fuzz` (R6's fuzzers)."""
