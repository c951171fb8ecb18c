"""The comparison: every loss method behind one signature, gated and measured the same way.
One registry (ours, the peers, the baselines and their presets), the float64 gate, the memory and
time meters, the sweep, the benchmark, the input regimes (with the corpus and language model of the
"trained" one) and units. Imports cce and spec only."""
